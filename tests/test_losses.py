"""Eq. (4) of Sabour et al. 2017 (margin loss) and the reconstruction loss, checked on the installed package."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from capsule_book.losses import MarginLoss, reconstruction_loss


def capsules(lengths):
    "Capsule vectors [batch, n_labels, 2] with the given lengths, pointing in varied directions."
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    angle = torch.arange(lengths.numel(), dtype=torch.float64).view_as(lengths)
    return torch.stack([lengths * torch.cos(angle), lengths * torch.sin(angle)], dim=-1)


def test_hand_computed_values():
    # image 0: class 1 present. ‖v‖ = (0.05, 0.5, 0.3): absent inside margin, present short by 0.4, absent long by 0.2
    # image 1: class 0 present. ‖v‖ = (0.95, 0.1, 0.7): present beyond m⁺, absent on m⁻, absent long by 0.6
    v = capsules([[0.05, 0.5, 0.3], [0.95, 0.1, 0.7]])
    loss = MarginLoss(3)(v, torch.tensor([1, 0]))
    image0 = 0.0 + 0.4**2 + 0.5 * 0.2**2          # 0.16 + 0.02 = 0.18
    image1 = 0.0 + 0.0 + 0.5 * 0.6**2             # 0.18
    torch.testing.assert_close(loss, torch.tensor((image0 + image1) / 2, dtype=torch.float64))
    torch.testing.assert_close(loss, torch.tensor(0.18, dtype=torch.float64))


def test_parameters_enter_as_in_eq4():
    v = capsules([[0.2, 0.6]])
    loss = MarginLoss(2, lambda_=0.25, m_positive=0.8, m_negative=0.3)(v, torch.tensor([0]))
    torch.testing.assert_close(loss, torch.tensor(0.6**2 + 0.25 * 0.3**2, dtype=torch.float64))


def test_loss_is_squared_not_linear():
    # the seed's version omits the square: for a present capsule of length 0.5 it gives 0.4, Eq. (4) gives 0.16
    loss = MarginLoss(1)(capsules([[0.5]]), torch.tensor([0]))
    torch.testing.assert_close(loss, torch.tensor(0.16, dtype=torch.float64))


lengths = st.lists(st.floats(0, 0.999), min_size=2, max_size=6)


@settings(max_examples=200, deadline=None)
@given(lengths, st.data())
def test_zero_exactly_when_every_length_is_on_its_side(ls, data):
    n = len(ls)
    label = data.draw(st.integers(0, n - 1))
    v = capsules([ls])
    norms = torch.linalg.vector_norm(v, dim=-1)[0]
    on_side = bool(norms[label] >= 0.9) and all(bool(norms[k] <= 0.1) for k in range(n) if k != label)
    loss = MarginLoss(n)(v, torch.tensor([label]))
    assert (loss == 0).item() == on_side
    assert loss >= 0


def test_batch_mean_and_class_sum():
    torch.manual_seed(0)
    v = torch.rand(5, 4, 3, dtype=torch.float64) * 0.5
    labels = torch.tensor([0, 3, 1, 1, 2])
    f = MarginLoss(4)
    per_image = torch.stack([f(v[b:b + 1], labels[b:b + 1]) for b in range(5)])
    torch.testing.assert_close(f(v, labels), per_image.mean())


def test_gradcheck_and_finite_gradient_at_zero():
    torch.manual_seed(0)
    v = (torch.rand(3, 4, 5, dtype=torch.float64) * 0.3).requires_grad_(True)
    labels = torch.tensor([0, 2, 3])
    assert torch.autograd.gradcheck(lambda t: MarginLoss(4)(t, labels), (v,))
    zero = torch.zeros(2, 4, 5, dtype=torch.float64, requires_grad=True)
    MarginLoss(4)(zero, torch.tensor([1, 2])).backward()
    assert torch.isfinite(zero.grad).all()


@pytest.mark.parametrize("labels", [[0, 4], [-1, 0], [10, 1]])
def test_labels_out_of_range(labels):
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        MarginLoss(4)(torch.zeros(2, 4, 3), torch.tensor(labels))


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\[batch, 4, d\].*\[2, 3, 5\]"):
        MarginLoss(4)(torch.zeros(2, 3, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels of shape \[2\]"):
        MarginLoss(4)(torch.zeros(2, 4, 5), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="integer"):
        MarginLoss(4)(torch.zeros(2, 4, 5), torch.tensor([0.0, 1.0]))


def test_reconstruction_loss_value_and_shapes():
    torch.manual_seed(0)
    images = torch.rand(3, 1, 28, 28, dtype=torch.float64)
    rec = torch.rand(3, 784, dtype=torch.float64)
    expected = sum(((rec[b] - images[b].flatten()) ** 2).sum() for b in range(3)) / 3
    torch.testing.assert_close(reconstruction_loss(rec, images), expected)
    torch.testing.assert_close(reconstruction_loss(rec.view(3, 1, 28, 28), images), expected)
    # the sum over pixels is 784 times the per-pixel mean that nn.MSELoss computes
    torch.testing.assert_close(reconstruction_loss(rec, images), 784 * torch.nn.functional.mse_loss(rec, images.view(3, -1)))
    assert reconstruction_loss(images, images) == 0


def test_reconstruction_loss_gradcheck():
    rec = torch.rand(2, 6, dtype=torch.float64, requires_grad=True)
    img = torch.rand(2, 2, 3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda r: reconstruction_loss(r, img), (rec,))


@pytest.mark.parametrize("a,b", [((3, 784), (3, 1, 28, 27)), ((3, 784), (2, 784)), ((784,), (1, 784))])
def test_reconstruction_loss_mismatch(a, b):
    with pytest.raises(ValueError, match="same number of pixels"):
        reconstruction_loss(torch.zeros(a), torch.zeros(b))
