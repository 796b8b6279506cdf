"""Procedure 1 of Sabour et al. 2017 (routing by agreement), checked on the installed package."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from capsule_book.routing import Router, agreement, coupling, predictions, route, total_input
from capsule_book.squash import squash


def naive_procedure_1(u, W, iterations):
    "Procedure 1 with explicit loops over batch, i and j, in float64 Python scalars where it matters."
    B, I, n = u.shape
    J, m = W.shape[1], W.shape[3]
    u_hat = torch.zeros(B, I, J, m, dtype=torch.float64)
    for b_, i, j in itertools.product(range(B), range(I), range(J)):
        u_hat[b_, i, j] = u[b_, i] @ W[i, j]                      # û_{j|i} = W_ij u_i
    v = torch.zeros(B, J, m, dtype=torch.float64)
    c = torch.zeros(B, I, J, dtype=torch.float64)
    for b_ in range(B):
        logits = [[0.0] * J for _ in range(I)]                   # b_ij = 0
        for _ in range(iterations):
            for i in range(I):                                   # Eq. (3), over the outputs j
                z = sum(math.exp(x) for x in logits[i])
                for j in range(J):
                    c[b_, i, j] = math.exp(logits[i][j]) / z
            for j in range(J):                                   # Eq. (2) then Eq. (1)
                s = torch.zeros(m, dtype=torch.float64)
                for i in range(I):
                    s = s + c[b_, i, j] * u_hat[b_, i, j]
                n2 = float(s @ s)
                v[b_, j] = s * (n2 / (1 + n2) / math.sqrt(n2 + 1e-8))   # Eq. (1) with the book's ε inside √
            for i, j in itertools.product(range(I), range(J)):   # b_ij += v_j · û_{j|i}
                logits[i][j] += float(v[b_, j] @ u_hat[b_, i, j])
    return v, c


def make(in_caps=7, out_caps=4, in_d=3, out_d=5, iterations=3, detach=True, batch=3, seed=0, std=0.5):
    g = torch.Generator().manual_seed(seed)
    r = Router(in_caps, out_caps, in_d, out_d, iterations, detach_intermediate=detach).double()
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g, dtype=torch.float64) * std)
    u = squash(torch.randn(batch, in_caps, in_d, generator=g, dtype=torch.float64))
    return r, u


@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
@pytest.mark.parametrize("detach", [True, False])
def test_matches_naive_loops(iterations, detach):
    r, u = make(iterations=iterations, detach=detach)
    v, c = r(u, return_coupling=True)
    v_ref, c_ref = naive_procedure_1(u, r.weight.detach(), iterations)
    assert (v - v_ref).abs().max() < 1e-10
    assert (c - c_ref).abs().max() < 1e-10


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),
       st.booleans(), st.integers(0, 10_000))
def test_coupling_sums_to_one_over_outputs(in_caps, out_caps, in_d, out_d, iterations, detach, seed):
    r, u = make(in_caps, out_caps, in_d, out_d, iterations, detach, batch=2, seed=seed, std=2.0)
    v, c = r(u, return_coupling=True)
    torch.testing.assert_close(c.sum(-1), torch.ones(2, in_caps, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (c > 0).all()
    assert (v.norm(dim=-1) < 1).all()


def test_one_iteration_is_uniform_coupling():
    r, u = make(iterations=1)
    v, c = r(u, return_coupling=True)
    torch.testing.assert_close(c, torch.full_like(c, 1 / 4), atol=0, rtol=0)
    u_hat = torch.einsum("bin,ijnm->bijm", u, r.weight)
    torch.testing.assert_close(v, squash(u_hat.sum(1) / 4), atol=1e-12, rtol=0)   # s_j = Σ_i û_{j|i} / out_caps
    # with as many inputs as outputs that is the squash of the mean prediction
    r, u = make(in_caps=4, out_caps=4, iterations=1)
    u_hat = torch.einsum("bin,ijnm->bijm", u, r.weight)
    torch.testing.assert_close(r(u), squash(u_hat.mean(1)), atol=1e-12, rtol=0)


def test_agreement_grows_when_one_output_agrees_with_all():
    # every lower capsule predicts the same vector for output 0 and a random one for the others
    I, J, d = 12, 4, 6
    g = torch.Generator().manual_seed(1)
    r = Router(I, J, d, d, iterations=1).double()
    with torch.no_grad():
        r.weight.copy_(0.5 * torch.randn(I, J, d, d, generator=g, dtype=torch.float64))
        r.weight[:, 0] = torch.eye(d, dtype=torch.float64)
    u = 0.6 * torch.nn.functional.normalize(torch.ones(1, I, d, dtype=torch.float64), dim=-1)
    u_hat = predictions(u, r.weight)
    prev = None
    for iterations in range(1, 6):
        v, c = route(u_hat, iterations)
        a0 = agreement(v, u_hat)[0, :, 0]          # a_i0 for every i
        c0, lengths = c[0, :, 0], v[0].norm(dim=-1)
        if prev is not None:
            assert (c0 > prev[0]).all()             # every part couples more to the agreeing whole
            assert (a0 > prev[1]).all()             # and agrees more with it
            assert lengths[0] > prev[2][0]          # the whole becomes more present
        else:
            first_lengths = lengths
        prev = c0, a0, lengths
    assert (prev[0] > 0.6).all() and prev[2][0] > 0.95
    assert (prev[2][1:] < first_lengths[1:]).all()   # the wholes nobody agrees on fade


@pytest.mark.parametrize("detach,iterations", [(False, 3), (False, 1), (True, 1)])
def test_gradcheck(detach, iterations):
    # with detach_intermediate and r > 1 the gradient leaves out the path through c on purpose (see the next test)
    r, u = make(in_caps=5, out_caps=3, in_d=2, out_d=3, batch=2, detach=detach, iterations=iterations)
    W = r.weight.detach().clone().requires_grad_(True)
    u.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda u_, W_: torch.func.functional_call(r, {"weight": W_}, (u_,)), (u, W))


def test_fused_gradient_equals_reference_with_detached_intermediates():
    r, u = make(detach=True)
    u.requires_grad_(True)
    v = r(u)
    gu, gW = torch.autograd.grad((v * torch.linspace(-1, 1, v.numel(), dtype=v.dtype).view_as(v)).sum(),
                                 (u, r.weight))
    v_ref, _ = route(predictions(u, r.weight), 3, detach_intermediate=True)
    gu_ref, gW_ref = torch.autograd.grad((v_ref * torch.linspace(-1, 1, v.numel(), dtype=v.dtype).view_as(v)).sum(),
                                         (u, r.weight))
    torch.testing.assert_close(gu, gu_ref, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(gW, gW_ref, atol=1e-12, rtol=1e-9)


def test_detach_changes_gradient_not_value():
    r1, u = make(detach=True)
    r2, _ = make(detach=False)
    u.requires_grad_(True)
    v1, v2 = r1(u), r2(u)
    torch.testing.assert_close(v1, v2, atol=1e-12, rtol=0)
    g1 = torch.autograd.grad(v1.norm(dim=-1).sum(), r1.weight)[0]
    g2 = torch.autograd.grad(v2.norm(dim=-1).sum(), r2.weight)[0]
    assert not torch.allclose(g1, g2)   # the full gradient also flows through the routing logits


def test_softmax_over_inputs_is_a_different_procedure():
    r, u = make(std=1.0)
    u_hat = predictions(u, r.weight)
    b = torch.zeros(u_hat.shape[:3], dtype=u.dtype)
    for _ in range(3):                                  # the seeds' version: softmax over dim 1 (the inputs)
        c_wrong = torch.softmax(b, dim=1)
        v_wrong = squash(total_input(c_wrong, u_hat))
        b = b + agreement(v_wrong, u_hat)
    v, c = r(u, return_coupling=True)
    torch.testing.assert_close(c_wrong.sum(1), torch.ones(3, 4, dtype=u.dtype))   # sums over inputs instead
    assert not torch.allclose(c_wrong.sum(-1), torch.ones(3, 7, dtype=u.dtype))
    assert not torch.allclose(v, v_wrong)


def test_weight_layout_is_the_seeds():
    r, u = make()
    assert r.weight.shape == (7, 4, 3, 5)
    assert (r.weight.grad is None)
    u_hat = torch.einsum("ijnm,bin->bijm", r.weight, u)   # the seed's einsum on our parameter
    v_ref, _ = route(u_hat, 3)
    torch.testing.assert_close(r(u), v_ref, atol=1e-12, rtol=0)


def test_default_initialisation_is_small():
    torch.manual_seed(0)
    r = Router(1152, 10, 8, 16)
    assert abs(r.weight.std().item() - 0.01) < 5e-4
    assert abs(r.weight.mean().item()) < 5e-4


@pytest.mark.parametrize("shape", [(2, 7, 4), (2, 6, 3), (7, 3), (2, 7, 3, 1)])
def test_shape_errors_name_expected_and_received(shape):
    r, _ = make()
    with pytest.raises(ValueError) as e:
        r(torch.zeros(shape, dtype=torch.float64))
    assert "[batch, 7, 3]" in str(e.value) and str(list(shape)) in str(e.value)


def test_iterations_must_be_positive():
    with pytest.raises(ValueError, match="at least 1 iteration"):
        Router(3, 2, 2, 2, iterations=0)


def test_coupling_function_normalises_last_axis():
    b = torch.randn(2, 5, 3, dtype=torch.float64)
    torch.testing.assert_close(coupling(b).sum(-1), torch.ones(2, 5, dtype=torch.float64))


def test_autocast_runs_and_stays_close_to_float32():
    torch.manual_seed(0)
    r = Router(64, 10, 8, 16)
    with torch.no_grad():
        r.weight.normal_(std=0.1)
    u = squash(torch.randn(4, 64, 8)).requires_grad_(True)
    v32 = r(u)
    g32 = torch.autograd.grad(v32.square().sum(), (u, r.weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v16, c16 = r(u, return_coupling=True)
    g16 = torch.autograd.grad(v16.float().square().sum(), (u, r.weight))
    # bfloat16 keeps 8 bits (ε = 2⁻⁷): the predictions, the total inputs and the squash are each rounded to it
    # (relative ε/2 each) while the sums accumulate in float32, so the outputs and gradients stay within a few ε:
    # c = 4 ε, measured 1.1 ε (outputs) and 0.9 ε (gradients) on AVX-512, AVX2 and SSE4 back-ends alike
    eps16 = torch.finfo(torch.bfloat16).eps
    assert (v16.float() - v32).abs().max() < 4 * eps16 * v32.abs().max()
    assert c16.dtype == torch.float32                      # the softmax runs in float32 under autocast: a sum of 10
    eps32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(c16.sum(-1), torch.ones(4, 64), rtol=0, atol=4 * eps32 * math.sqrt(10))
    for a, b in zip(g16, g32):
        assert a.dtype == torch.float32 and ((a - b).norm() / b.norm()) < 4 * eps16


def test_returned_coupling_is_contiguous_in_the_documented_layout():
    r, u = make()
    _, c = r(u, return_coupling=True)
    assert c.is_contiguous() and c.shape == (3, 7, 4)
    assert torch.equal(c.view(-1, 4).sum(-1) > 0.999, torch.ones(21, dtype=torch.bool))
