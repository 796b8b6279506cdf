"""Appendix E: the convolution computed through the discrete Fourier transform equals F.conv2d, values and gradients."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from capsule_book.capsnet import CapsNet, PrimaryCaps
from capsule_book.utils import round_off
from capsule_book.fourier_conv import dft_matrix, fourier_conv2d, inverse_matrix, kernel_spectrum

EPS32 = torch.finfo(torch.float32).eps
K_PRIMARY = 256 * 9 * 9                  # terms of each sum of the PrimaryCaps convolution, C·kh·kw: its longest reduction


def _round_off(ref: torch.Tensor, n: int = K_PRIMARY, c: float = 4.0) -> float:
    """capsule_book.utils.round_off for the PrimaryCaps sums (n = C·kh·kw terms). On AVX-512, AVX2 and SSE4 back-ends
    the differences between the two convolutions stay below 0.4·ε√n·max|ref|, so c = 4 leaves a factor of ten."""
    return round_off(ref, n, c)


@given(H=st.integers(1, 9), W=st.integers(1, 9), data=st.data())
@settings(max_examples=40, deadline=None)
def test_dft_and_inverse_matrices_match_torch_fft(H, W, data):
    kh, kw = data.draw(st.integers(1, H)), data.draw(st.integers(1, W))
    sh, sw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(H * 100 + W)
    x = torch.randn(H, W, dtype=torch.float64, generator=g)
    ref = torch.fft.rfft2(x)
    spec = dft_matrix(H, W) @ x.flatten()
    torch.testing.assert_close(spec, torch.cat([ref.real.flatten(), ref.imag.flatten()]), rtol=0, atol=1e-10)
    k = torch.randn(kh, kw, dtype=torch.float64, generator=g)
    kref = torch.fft.rfft2(k, s=(H, W))
    torch.testing.assert_close(dft_matrix(H, W, kh, kw) @ k.flatten(),
                               torch.cat([kref.real.flatten(), kref.imag.flatten()]), rtol=0, atol=1e-10)
    y = inverse_matrix(H, W, kh, kw, sh, sw).T @ spec                     # back to the strided valid positions
    torch.testing.assert_close(y, x[:H - kh + 1:sh, :W - kw + 1:sw].flatten(), rtol=0, atol=1e-10)


@given(B=st.integers(1, 3), C=st.integers(1, 4), O=st.integers(1, 4), H=st.integers(1, 10), W=st.integers(1, 10),
       data=st.data())
@settings(max_examples=40, deadline=None)
def test_values_and_gradients_equal_conv2d_float64(B, C, O, H, W, data):
    kh, kw = data.draw(st.integers(1, H)), data.draw(st.integers(1, W))
    stride = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
    with_bias = data.draw(st.booleans())
    g = torch.Generator().manual_seed(B + 10 * C + 100 * O + 1000 * H + 10000 * W)
    x = torch.randn(B, C, H, W, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(O, C, kh, kw, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(O, dtype=torch.float64, generator=g, requires_grad=True) if with_bias else None
    y_ref, y = F.conv2d(x, w, b, stride=stride), fourier_conv2d(x, w, b, stride)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    gy = torch.randn_like(y_ref)
    inputs = (x, w, b) if with_bias else (x, w)
    for got, want in zip(torch.autograd.grad(y, inputs, gy), torch.autograd.grad(y_ref, inputs, gy)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_gradcheck_of_the_hand_written_backward():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 3, 7, 6, dtype=torch.float64, generator=g, requires_grad=True),
            torch.randn(4, 3, 3, 2, dtype=torch.float64, generator=g, requires_grad=True),
            torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)]
    assert torch.autograd.gradcheck(lambda x, w, b: fourier_conv2d(x, w, b, (2, 3)), args)


def test_primary_caps_shape_float32_matches_conv2d_to_round_off():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 256, 20, 20, generator=g, requires_grad=True)
    w = (torch.randn(256, 256, 9, 9, generator=g) * 0.01).requires_grad_()
    b = (torch.randn(256, generator=g) * 0.01).requires_grad_()
    y_ref, y = F.conv2d(x, w, b, stride=2), fourier_conv2d(x, w, b, 2)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=_round_off(y_ref))
    gy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, (x, w, b), gy), torch.autograd.grad(y_ref, (x, w, b), gy)):
        torch.testing.assert_close(got, want, rtol=0, atol=_round_off(want))   # each sums over at most C·kh·kw terms


def test_cached_kernel_spectrum_gives_the_same_result_and_is_checked():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 3, 8, 8, generator=g), torch.randn(5, 3, 3, 3, generator=g)
    Wh = kernel_spectrum(w, 8, 8)
    assert Wh.shape == (2, 8 * 5, 3, 5)
    torch.testing.assert_close(fourier_conv2d(x, w, None, 1, weight_spectrum=Wh), fourier_conv2d(x, w, None, 1),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"kernel_spectrum\(weight, 8, 8\)"):
        fourier_conv2d(x, w, None, 1, weight_spectrum=kernel_spectrum(w, 9, 9))


@pytest.mark.parametrize("x_shape, w_shape, bias_shape, stride, message", [
    ((3, 8, 8), (2, 3, 3, 3), None, 1, r"x \[B,C,H,W\]"),
    ((1, 3, 8, 8), (2, 4, 3, 3), None, 1, "expects C = 4 input channels, x has 3"),
    ((1, 3, 4, 4), (2, 3, 5, 5), None, 1, "kernel 5x5 is larger than the 4x4 input"),
    ((1, 3, 8, 8), (2, 3, 3, 3), (3,), 1, r"bias must have shape \[2\]"),
    ((1, 3, 8, 8), (2, 3, 3, 3), None, 0, "stride must be positive"),
])
def test_bad_input_is_named(x_shape, w_shape, bias_shape, stride, message):
    b = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(ValueError, match=message):
        fourier_conv2d(torch.zeros(x_shape), torch.zeros(w_shape), b, stride)
    with pytest.raises(TypeError, match="floating dtype"):
        fourier_conv2d(torch.zeros(1, 3, 8, 8), torch.zeros(2, 3, 3, 3, dtype=torch.float64))


def test_capsnet_is_the_same_function_with_either_convolution():
    torch.manual_seed(0)
    fourier, direct = CapsNet(1, conv_impl="fourier"), CapsNet(1, conv_impl="direct")
    direct.load_state_dict(fourier.state_dict())               # same parameters, same state_dict keys
    x, y = torch.rand(3, 1, 28, 28), torch.tensor([1, 2, 3])
    out_f, out_d = fourier(x, y), direct(x, y)
    # only PrimaryCaps differs: its round-off, carried through squash and routing at the capsules' scale
    torch.testing.assert_close(out_f.caps, out_d.caps, rtol=0, atol=_round_off(out_d.caps))
    out_f.caps.pow(2).sum().backward(); out_d.caps.pow(2).sum().backward()
    gf, gd = fourier.primary_caps.conv.weight.grad, direct.primary_caps.conv.weight.grad
    torch.testing.assert_close(gf, gd, rtol=0, atol=_round_off(gd))
    with pytest.raises(ValueError, match="conv_impl must be"):
        PrimaryCaps(conv_impl="fft")


def test_evaluation_reuses_the_kernel_spectrum_until_the_weights_change():
    torch.manual_seed(0)
    pc, ref = PrimaryCaps(), PrimaryCaps(conv_impl="direct")
    x = torch.randn(2, 256, 20, 20)
    with torch.no_grad():
        pc(x)
        first = pc._spectrum[1]
        pc(x)
        assert pc._spectrum[1] is first                          # reused while the weights stay
        pc.conv.weight.mul_(-1)                                  # an in-place update, as an optimiser makes
        ref.load_state_dict(pc.state_dict())
        want = ref(x)
        torch.testing.assert_close(pc(x), want, rtol=0, atol=_round_off(want))   # recomputed: the new weights count
        assert pc._spectrum[1] is not first
    pc(x).sum().backward()                                       # with gradients: no cache, a true gradient
    assert pc._spectrum is None and pc.conv.weight.grad is not None
