"""Eq. (1) of Sabour et al. 2017, checked on the installed package (the notebook checks it too)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from capsule_book.squash import Squash, squash

EPS32 = torch.finfo(torch.float32).eps

vectors = arrays("float64", st.tuples(st.integers(1, 5), st.integers(1, 16)),
                 elements=st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False))


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_length_is_eq1(x):
    s = torch.from_numpy(x)
    v = squash(s)
    n = s.norm(dim=-1)
    torch.testing.assert_close(v.norm(dim=-1), n**2 / (1 + n**2), atol=1e-6, rtol=0)
    assert (v.norm(dim=-1) < 1).all()


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_length_is_eq1_float32(x):
    s = torch.from_numpy(x).float()
    n = s.double().norm(dim=-1)
    exact = n**2 / (1 + n**2) * n / torch.sqrt(n**2 + 1e-8)        # Eq. (1) with squash's ε = 1e-8 inside the √
    # relative round-off: ‖s‖² sums d terms, then a few operations per element (c = 4); below float32's smallest
    # normal number (‖s‖ < 1e-19, so ‖v‖ < 1e-50) the products underflow, hence the absolute floor
    torch.testing.assert_close(squash(s).double().norm(dim=-1), exact,
                               rtol=4 * EPS32 * math.sqrt(s.shape[-1]), atol=torch.finfo(torch.float32).tiny)


@settings(max_examples=100, deadline=None)
@given(vectors)
def test_direction_preserved(x):
    s = torch.from_numpy(x)
    keep = s.norm(dim=-1) > 1e-3
    v = squash(s)[keep]
    s = s[keep]
    cos = (v * s).sum(-1) / (v.norm(dim=-1) * s.norm(dim=-1))
    torch.testing.assert_close(cos, torch.ones_like(cos), atol=1e-9, rtol=0)


def test_known_values():
    v = squash(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))  # lengths 5 and 1
    torch.testing.assert_close(v, torch.tensor([[25 / 26 * 0.6, 25 / 26 * 0.8], [0.0, 0.5]]),
                               rtol=4 * EPS32, atol=0)                     # a few float32 roundings of each value


def test_dim_argument_and_module():
    s = torch.randn(2, 8, 6, dtype=torch.float64)
    torch.testing.assert_close(squash(s, dim=1), squash(s.transpose(1, 2)).transpose(1, 2))
    torch.testing.assert_close(Squash(dim=1)(s), squash(s, dim=1))
    n = s.norm(dim=1)
    torch.testing.assert_close(squash(s, dim=1).norm(dim=1), n**2 / (1 + n**2))


def test_zero_input_zero_output_finite_gradient():
    s = torch.zeros(3, 8, requires_grad=True)
    v = squash(s)
    assert torch.equal(v, torch.zeros_like(v))
    v.sum().backward()
    assert torch.isfinite(s.grad).all()
    assert torch.equal(s.grad, torch.zeros_like(s.grad))


def test_gradcheck_float64():
    s = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: squash(t, dim=-1), (s,))
    assert torch.autograd.gradcheck(lambda t: squash(t, dim=1), (s,))


@pytest.mark.parametrize("bad", [[3.0, 4.0], 5.0, "s", None])
def test_non_tensor_input_is_refused(bad):
    with pytest.raises(TypeError, match="torch.Tensor"):
        squash(bad)
