"""CapsNet (Sabour et al. 2017) as assembled in chapter 4: parameter count, masking, the loss, learning."""
import pytest
import torch
import torch.nn.functional as F

from capsule_book.capsnet import CapsNet, PrimaryCaps, capsnet_loss, mask_capsules
from capsule_book.squash import squash


def test_parameter_count_matches_paper():
    m = CapsNet()
    n = sum(p.numel() for p in m.parameters())
    n_dec = sum(p.numel() for p in m.decoder.parameters())
    assert n == 8_215_568 and n_dec == 1_411_344
    assert abs(n / 8.2e6 - 1) < 0.01 and abs((n - n_dec) / 6.8e6 - 1) < 0.01


def test_primary_capsule_layout_groups_maps_8t_to_8t_plus_7_at_one_position():
    torch.manual_seed(0)
    pc = PrimaryCaps()
    x = torch.randn(1, 256, 20, 20)
    with torch.no_grad():
        s = pc.convolve(x)                               # [1, 256, 6, 6], the maps pc(x) squashes
        u = pc(x)
    t, y, xx = 7, 3, 1
    expected = squash(s[0, 8 * t: 8 * t + 8, y, xx])     # one capsule: 8 maps of type t at (y, x)
    torch.testing.assert_close(u[0, 36 * t + 6 * y + xx], expected)


def test_masking_by_label_in_training_by_prediction_in_eval():
    torch.manual_seed(0)
    m = CapsNet(routing_iterations=1)
    x = torch.rand(6, 1, 28, 28)
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    with torch.no_grad():
        m.train()
        out = m(x, labels)
        torch.testing.assert_close(out.reconstructions, m.reconstruct(out.caps, labels))
        assert not torch.allclose(out.reconstructions, m.reconstruct(out.caps, (labels + 1) % 10))
        m.eval()
        out = m(x, labels)
        assert torch.equal(out.predictions, out.caps.norm(dim=-1).argmax(-1))
        torch.testing.assert_close(out.reconstructions, m.reconstruct(out.caps, out.predictions))
        m.train()
        out_nolabel = m(x)                                # training mode without labels: the prediction
        torch.testing.assert_close(out_nolabel.reconstructions, m.reconstruct(out_nolabel.caps, out_nolabel.predictions))


def test_mask_keeps_exactly_one_capsule():
    caps = torch.randn(3, 10, 16)
    flat = mask_capsules(caps, torch.tensor([2, 0, 9])).view(3, 10, 16)
    for b, j in enumerate([2, 0, 9]):
        assert torch.equal(flat[b, j], caps[b, j])
        assert flat[b].abs().sum() == caps[b, j].abs().sum()


def test_wrong_image_shape_names_expected_shape():
    with pytest.raises(ValueError, match=r"\[B,1,28,28\].*\[2, 28, 28\]"):
        CapsNet(routing_iterations=1)(torch.rand(2, 28, 28))


def test_loss_is_margin_plus_scaled_summed_reconstruction():
    torch.manual_seed(1)
    m = CapsNet(routing_iterations=2)
    x, y = torch.rand(5, 1, 28, 28), torch.tensor([3, 1, 4, 1, 5])
    out = m(x, y)
    total, l_m, l_r = capsnet_loss(out, x, y)
    n = out.caps.norm(dim=-1)
    T = F.one_hot(y, 10).float()
    torch.testing.assert_close(l_m, (T * F.relu(0.9 - n) ** 2 + 0.5 * (1 - T) * F.relu(n - 0.1) ** 2).sum(-1).mean())
    torch.testing.assert_close(l_r, ((out.reconstructions - x) ** 2).sum((1, 2, 3)).mean())
    torch.testing.assert_close(total, l_m + 0.0005 * l_r)


def test_a_few_steps_on_a_fixed_batch_lower_the_loss():
    from capsule_book.data import load_mnist
    images, y = load_mnist(False, limit=16, sample=True)         # sixteen real test digits (the shipped sample)
    x = images[:, None].float() / 255
    torch.manual_seed(0)
    m = CapsNet(routing_iterations=1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(6):
        loss = capsnet_loss(m(x, y), x, y)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_routed_with_sets_the_iterations_and_restores_them_even_on_error():
    from capsule_book.capsnet import routed_with
    m = CapsNet(routing_iterations=3)
    u = torch.randn(2, 1152, 8)
    with routed_with(m, 1):
        c1 = m.digit_caps(u, return_coupling=True)[1]
    assert m.digit_caps.iterations == 3
    assert torch.allclose(c1, torch.full_like(c1, 0.1))          # one iteration: uniform coupling
    with pytest.raises(RuntimeError):
        with routed_with(m, 2):
            raise RuntimeError("inside")
    assert m.digit_caps.iterations == 3


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return CapsNet(1).eval()


def test_images_that_are_not_pixels_in_0_1_are_refused_by_name(net):
    x = torch.rand(4, 1, 28, 28)
    bad = x.clone()
    bad[2, 0, 5, 5] = float("nan")
    with pytest.raises(ValueError, match=r"^images must be finite; image\(s\) \[2\] hold NaN or inf$"):
        net(bad)
    bad[2, 0, 5, 5], bad[3, 0, 0, 0] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"image\(s\) \[2, 3\] hold NaN or inf"):
        net(bad)
    with pytest.raises(ValueError, match=r"^CapsNet expects pixels in \[0, 1\], got values in \[.*, 255\]: divide by "
                                         r"255$"):
        net((x * 255).round())
    with pytest.raises(ValueError, match=r"expects pixels in \[0, 1\], got values in \[-0.25, 0.75\]$"):
        net(torch.tensor([-0.25, 0.75]).repeat(392).view(1, 1, 28, 28))      # normalised digits
    with torch.no_grad():
        assert torch.equal(net(x).caps, net(x.clone()).caps)  # pixels in [0, 1] pass, 0 and 1 included
        net(torch.zeros(1, 1, 28, 28)); net(torch.ones(1, 1, 28, 28))


def test_an_empty_batch_and_float64_images_are_refused_clearly(net):
    with pytest.raises(ValueError, match=r"^CapsNet needs at least one image, got an empty batch"):
        net(torch.rand(0, 1, 28, 28))
    with pytest.raises(TypeError, match=r"^CapsNet's weights are torch.float32 and the images torch.float64: convert "
                                        r"the images with images.to\(torch.float32\)"):
        net(torch.rand(2, 1, 28, 28, dtype=torch.float64))
    # no silent conversion: a float64 model takes float64 images
    wide = CapsNet(1).double().eval()
    with torch.no_grad():
        assert wide(torch.rand(2, 1, 28, 28, dtype=torch.float64)).caps.dtype == torch.float64
