"""The part capsules' Gaussian mixture of Chapter 7, checked on the installed package."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributions import Categorical, Independent, MixtureSameFamily, Normal

from capsule_book.gmm import gaussian_log_density, gmm_log_joint, gmm_log_likelihood, gmm_posterior

EPS32 = torch.finfo(torch.float32).eps


def _random(B=3, M=7, C=5, D=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, M, D, generator=g, dtype=dtype) * 2
    presence = torch.rand(B, M, generator=g) > 0.3
    means = torch.randn(B, C, D, generator=g, dtype=dtype)
    scales = 0.2 + torch.rand(B, C, generator=g, dtype=dtype) * 2
    logits = torch.randn(B, C, generator=g, dtype=dtype) * 2
    return x, presence, means, scales, logits


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 6), st.integers(1, 3), st.integers(0, 10**6))
def test_equals_mixture_same_family(B, M, C, D, seed):
    x, presence, means, scales, logits = _random(B, M, C, D, seed)
    mix = MixtureSameFamily(Categorical(logits=logits), Independent(Normal(means, scales[..., None].expand(B, C, D)), 1))
    per_point = mix.log_prob(x.transpose(0, 1)).transpose(0, 1)  # [B, M]
    expected = (per_point * presence).sum(1)
    torch.testing.assert_close(gmm_log_likelihood(x, presence, means, scales, logits), expected)


def test_equals_eq5_with_presence_logits():
    g = torch.Generator().manual_seed(3)
    B, K, N, M = 2, 3, 4, 11
    a_k = torch.rand(B, K, generator=g, dtype=torch.float64)
    a_kn = torch.rand(B, K, N, generator=g, dtype=torch.float64)
    mu = torch.randn(B, K, N, 2, generator=g, dtype=torch.float64)
    lam = 0.5 + torch.rand(B, K, N, generator=g, dtype=torch.float64)
    x = torch.randn(B, M, 2, generator=g, dtype=torch.float64)
    w = a_k[..., None] * a_kn / (a_k[..., None] * a_kn).sum((1, 2), keepdim=True)
    dens = torch.exp(-((x[:, :, None, None] - mu[:, None]) ** 2).sum(-1) / (2 * lam[:, None] ** 2)) \
        / (2 * math.pi * lam[:, None] ** 2)
    eq5 = (w[:, None] * dens).sum((2, 3)).prod(1)
    ll = gmm_log_likelihood(x, torch.ones(B, M, dtype=torch.bool), mu.flatten(1, 2), lam.flatten(1, 2),
                            torch.log(a_k[..., None] * a_kn).flatten(1))
    torch.testing.assert_close(ll, torch.log(eq5))


def test_gaussian_log_density_is_eq_7_1():
    x, _, means, scales, _ = _random(D=3)
    ref = Independent(Normal(means[:, None], scales[:, None, :, None].expand(-1, 1, -1, 3)), 1).log_prob(x[:, :, None])
    torch.testing.assert_close(gaussian_log_density(x, means, scales), ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_1d_mixture_integrates_to_one(seed):
    g = torch.Generator().manual_seed(seed)
    C = 4
    means = torch.randn(C, generator=g, dtype=torch.float64) * 3
    scales = 0.05 + torch.rand(C, generator=g, dtype=torch.float64)
    logits = torch.randn(C, generator=g, dtype=torch.float64)
    grid = torch.linspace(-25, 25, 100001, dtype=torch.float64)
    G = len(grid)
    ll = gmm_log_likelihood(grid[:, None, None], torch.ones(G, 1, dtype=torch.bool),
                            means.expand(G, C)[..., None], scales.expand(G, C), logits.expand(G, C))
    assert abs(torch.trapezoid(ll.exp(), grid).item() - 1) < 1e-6


def test_2d_mixture_integrates_to_one():
    means = torch.tensor([[0.0, 0.0], [1.5, -1.0], [-2.0, 0.5]], dtype=torch.float64)
    scales = torch.tensor([0.3, 0.5, 0.8], dtype=torch.float64)
    logits = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    u = torch.linspace(-8, 8, 801, dtype=torch.float64)
    X, Y = torch.meshgrid(u, u, indexing="ij")
    pts = torch.stack([X.flatten(), Y.flatten()], -1)[:, None, :]
    G = pts.shape[0]
    ll = gmm_log_likelihood(pts, torch.ones(G, 1, dtype=torch.bool), means.expand(G, 3, 2), scales.expand(G, 3),
                            logits.expand(G, 3))
    total = torch.trapezoid(torch.trapezoid(ll.exp().view(801, 801), u), u).item()
    assert abs(total - 1) < 1e-5


@pytest.mark.parametrize("scale", [1.0, 1e-2, 1e-4])
@pytest.mark.parametrize("offset", [0.0, 100.0, 1000.0])
def test_finite_values_and_gradients_float32(scale, offset):
    x, presence, means, _, logits = _random(B=4, M=11, C=12, dtype=torch.float32)
    x = x + offset
    means = means.clone().requires_grad_()
    log_scales = torch.full((4, 12), math.log(scale), requires_grad=True)
    logits = logits.clone().requires_grad_()
    ll = gmm_log_likelihood(x, presence, means, log_scales.exp(), logits)
    ll.sum().backward()
    assert torch.isfinite(ll).all()
    for t in (means, log_scales, logits):
        assert torch.isfinite(t.grad).all()
    args64 = (x.double(), presence, means.double(), log_scales.double().exp(), logits.double())
    exact = gmm_log_likelihood(*args64)
    size = (torch.logsumexp(gmm_log_joint(*args64), -1).abs() * presence).sum(-1)   # Σ_m |log p(x_m)|, [B]
    # each log p(x_m) is good to a few ε of its largest term; the sums over D, C and M add like a random walk: c = 4
    assert ((ll.double() - exact).abs() <= 4 * EPS32 * math.sqrt(2 + 12 + 11) * size).all()


def test_absent_points_change_nothing():
    x, presence, means, scales, logits = _random(B=4, M=9)
    means.requires_grad_()
    ll = gmm_log_likelihood(x, presence, means, scales, logits)
    (grad,) = torch.autograd.grad(ll.sum(), means)
    junk = x.clone()
    junk[~presence] = torch.tensor([float("nan"), float("inf")], dtype=x.dtype)
    ll_junk = gmm_log_likelihood(junk, presence, means, scales, logits)
    (grad_junk,) = torch.autograd.grad(ll_junk.sum(), means)
    assert torch.equal(ll, ll_junk) and torch.equal(grad, grad_junk)
    for b in range(4):  # the same as removing the absent points
        keep = presence[b]
        ref = gmm_log_likelihood(x[b:b + 1, keep], presence[b:b + 1, keep], means[b:b + 1], scales[b:b + 1],
                                 logits[b:b + 1])
        torch.testing.assert_close(ll[b:b + 1], ref)
    post_junk = gmm_posterior(junk, presence, means, scales, logits)
    torch.testing.assert_close(post_junk, gmm_posterior(x, presence, means, scales, logits))


def test_empty_example_has_zero_log_likelihood():
    x, _, means, scales, logits = _random(B=2, M=5)
    presence = torch.zeros(2, 5, dtype=torch.bool)
    assert torch.equal(gmm_log_likelihood(x, presence, means, scales, logits), torch.zeros(2, dtype=x.dtype))
    assert (gmm_posterior(x, presence, means, scales, logits) == 0).all()


def test_float_presence_accepted():
    x, presence, means, scales, logits = _random()
    torch.testing.assert_close(gmm_log_likelihood(x, presence.float(), means, scales, logits),
                               gmm_log_likelihood(x, presence, means, scales, logits))


def test_logits_shift_invariant():
    x, presence, means, scales, logits = _random()
    torch.testing.assert_close(gmm_log_likelihood(x, presence, means, scales, logits + 7.0),
                               gmm_log_likelihood(x, presence, means, scales, logits))


def test_posterior_is_bayes_and_rows_sum_to_one():
    x, presence, means, scales, logits = _random(B=3, M=8, C=6)
    post = gmm_posterior(x, presence, means, scales, logits)
    sums = post.sum(-1)
    torch.testing.assert_close(sums[presence], torch.ones_like(sums[presence]))
    assert (sums[~presence] == 0).all() and (post >= 0).all()
    joint = torch.softmax(logits, -1)[:, None] * gaussian_log_density(x, means, scales).exp()
    bayes = joint / joint.sum(-1, keepdim=True)
    torch.testing.assert_close(post[presence], bayes[presence])


def test_posterior_finite_for_tiny_scales_and_far_points():
    x, presence, means, _, logits = _random(B=2, M=6, C=4, dtype=torch.float32)
    post = gmm_posterior(x + 500, presence, means, torch.full((2, 4), 1e-4), logits)
    assert torch.isfinite(post).all()
    torch.testing.assert_close(post.sum(-1)[presence], torch.ones(int(presence.sum())),
                               rtol=0, atol=4 * EPS32 * math.sqrt(4))       # a sum of C = 4 probabilities


def test_naive_product_underflows_where_log_space_does_not():
    # Eq. (5) literally: 11 points 6 standard deviations from their vote, float32.
    x = torch.zeros(1, 11, 2)
    x[..., 0] = 6.0
    args = (torch.zeros(1, 1, 2), torch.ones(1, 1), torch.zeros(1, 1))
    naive = torch.log(gaussian_log_density(x, args[0], args[1]).exp().sum(-1).prod(-1))
    assert naive.item() == -math.inf
    ll = gmm_log_likelihood(x, torch.ones(1, 11, dtype=torch.bool), *args)
    exact = 11 * (-math.log(2 * math.pi) - 18.0)
    torch.testing.assert_close(ll, torch.tensor([exact]), rtol=0,
                               atol=4 * EPS32 * math.sqrt(2 + 11) * abs(exact))   # sums over D and M


@pytest.mark.parametrize("bad", ["presence", "means", "scales", "mixing_logits"])
def test_wrong_shapes_refused(bad):
    x, presence, means, scales, logits = _random()
    args = dict(x=x, presence=presence, means=means, scales=scales, mixing_logits=logits)
    args[bad] = args[bad][..., :-1] if args[bad].dim() > 1 else args[bad]
    with pytest.raises(ValueError, match=bad):
        gmm_log_likelihood(**args)
    with pytest.raises(ValueError, match=bad):
        gmm_posterior(**args)


def _eq_7_4_by_hand(x, presence, means, scales, logits, b):
    "Eq. (7.4) in float64, literally: Σ_c a_c/(A+b) N(x|μ_c,λ_c) + b/(A+b)·b per present point, logs summed."
    a = logits.exp()                                                     # [B, C]
    A = a.sum(-1)                                                        # [B]
    D = x.shape[-1]
    dens = torch.exp(-((x[:, :, None] - means[:, None]) ** 2).sum(-1) / (2 * scales[:, None] ** 2)) \
        / (2 * math.pi * scales[:, None] ** 2) ** (D / 2)               # [B, M, C]
    p = (a[:, None] / (A[:, None, None] + b) * dens).sum(-1) + b * b / (A[:, None] + b)
    return torch.where(presence, p.log(), torch.zeros_like(p)).sum(-1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 6), st.integers(1, 3), st.integers(0, 10**6),
       st.sampled_from([0.01, 0.1, 1.0]))
def test_background_is_eq_7_4(B, M, C, D, seed, b):
    x, presence, means, scales, logits = _random(B, M, C, D, seed)
    torch.testing.assert_close(gmm_log_likelihood(x, presence, means, scales, logits, background=b),
                               _eq_7_4_by_hand(x, presence, means, scales, logits, b))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1e-4, 1e-2, 0.3]), st.sampled_from([0.0, 5.0, 1e3]))
def test_background_bounds_the_cost_of_a_point_eq_7_5(scale, offset):
    x, presence, means, scales, logits = _random(B=2, M=6, C=12, D=2, seed=5, dtype=torch.float32)
    presence[:] = True
    scales = torch.full_like(scales, scale).requires_grad_()
    ll = gmm_log_likelihood(x + offset, presence, means, scales, torch.sigmoid(logits).log(), background=0.01)
    bound = 6 * -math.log(0.01 ** 2 / (12 + 0.01))                    # Eq. (7.5) per point, 6 points, presences <= 1
    assert (-ll <= bound + 4 * EPS32 * math.sqrt(13 + 6) * bound).all()  # round-off of 6 log-sum-exps of C + 1 terms
    ll.sum().backward()
    assert torch.isfinite(scales.grad).all()
    if offset == 1e3:                                                    # nothing covers the points: cost near the cap
        without = gmm_log_likelihood(x + offset, presence, means, scales.detach(), torch.sigmoid(logits).log())
        assert (-without > 1e3 * bound).all() and (-ll > bound - 6 * math.log(12.01)).all()


def test_background_none_is_eq_7_2_and_bad_values_refused():
    x, presence, means, scales, logits = _random()
    assert torch.equal(gmm_log_likelihood(x, presence, means, scales, logits),
                       gmm_log_likelihood(x, presence, means, scales, logits, background=None))
    for bad in (0.0, -0.01, "0.01"):
        with pytest.raises(ValueError, match="background must be a positive"):
            gmm_log_likelihood(x, presence, means, scales, logits, background=bad)


def test_posterior_with_background_leaves_out_its_share():
    x, presence, means, scales, logits = _random(seed=4)
    b = 0.01
    post = gmm_posterior(x, presence, means, scales, logits, background=b)
    a = logits.exp()
    dens = torch.exp(-((x[:, :, None] - means[:, None]) ** 2).sum(-1) / (2 * scales[:, None] ** 2)) \
        / (2 * math.pi * scales[:, None] ** 2)
    joint = torch.cat([a[:, None] * dens, torch.full_like(dens[..., :1], b * b)], -1)   # common factor 1/(A+b) cancels
    bayes = (joint / joint.sum(-1, keepdim=True))[..., :-1]
    torch.testing.assert_close(post[presence], bayes[presence])
    assert (post[~presence] == 0).all() and (post.sum(-1)[presence] < 1).all()


def test_one_log_joint_gives_both_and_its_shape_is_checked():
    from capsule_book.gmm import gmm_log_likelihood_from_joint, gmm_posterior_from_joint
    x, presence, means, scales, logits = _random(seed=5)
    B, M, C = x.shape[0], x.shape[1], means.shape[1]
    joint = gmm_log_joint(x, presence, means, scales, logits, background=0.01)
    assert joint.shape == (B, M, C + 1)                                  # the background's column last
    torch.testing.assert_close(joint[..., -1], torch.full((B, M), 2 * math.log(0.01), dtype=joint.dtype)
                               - torch.logsumexp(torch.cat([logits, torch.full((B, 1), math.log(0.01), dtype=logits.dtype)], 1), 1)[:, None])
    torch.testing.assert_close(gmm_log_likelihood_from_joint(joint, presence),
                               gmm_log_likelihood(x, presence, means, scales, logits, background=0.01))
    torch.testing.assert_close(gmm_posterior_from_joint(joint, presence, C),
                               gmm_posterior(x, presence, means, scales, logits, background=0.01))
    with pytest.raises(ValueError, match=r"log_joint must be \[B, M, C\].*got \(\d+, \d+, \d+\) and \(\d+, 3\)"):
        gmm_log_likelihood_from_joint(joint, presence[:, :3])
    with pytest.raises(ValueError, match=r"C >= 99"):
        gmm_posterior_from_joint(joint, presence, 99)


@pytest.mark.parametrize("bad", [-0.3, 0.0, float("nan"), float("inf"), -float("inf")])
def test_scales_that_are_no_standard_deviation_are_refused_by_every_function(bad):
    x, presence, means, scales, logits = _random()
    presence[1, 0] = True                                                # example 1 has a point, so uses its scales
    scales[1, 2] = bad
    message = r"^scales must be positive and finite .*got min .*scales\[1, 2\] = "
    for f in (gmm_log_likelihood, gmm_posterior, gmm_log_joint):
        with pytest.raises(ValueError, match=message):
            f(x, presence, means, scales, logits)
        with pytest.raises(ValueError, match=message):
            f(x, presence, means, scales, logits, background=0.01)
    with pytest.raises(ValueError, match=message):
        gaussian_log_density(x, means, scales)
    if bad == -0.3:
        with pytest.raises(ValueError, match=r"got min -0\.3, max "):
            gmm_log_likelihood(x, presence, means, scales, logits)


def test_an_empty_example_uses_none_of_its_scales():
    "The CCAE gives an example with no point zeros for its scales: not refused, and neither NaN value nor gradient."
    x, presence, means, scales, logits = _random(B=3)
    presence[1] = False
    presence[0, 0] = presence[2, 0] = True
    bad = scales.clone()
    bad[1] = torch.tensor([0.0, -1.0, float("nan"), float("inf"), 0.0])
    means.requires_grad_()
    bad.requires_grad_()
    ll = gmm_log_likelihood(x, presence, means, bad, logits)
    (g_means, g_scales) = torch.autograd.grad(ll.sum(), (means, bad))
    assert ll[1] == 0 and torch.isfinite(g_means).all() and (g_scales[1] == 0).all()
    torch.testing.assert_close(ll, gmm_log_likelihood(x, presence, means, scales, logits), rtol=0, atol=0)
    assert (gmm_posterior(x, presence, means, bad, logits)[1] == 0).all()
    with pytest.raises(ValueError, match=r"scales\[1, 0\] = 0"):           # without presence every scale is used
        gaussian_log_density(x, means, bad)


def _diagonal(B=3, M=7, C=5, D=2, seed=0):
    "Like _random, with one standard deviation per coordinate: scales [B, C, D]."
    x, presence, means, _, logits = _random(B, M, C, D, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return x, presence, means, 0.2 + torch.rand(B, C, D, generator=g, dtype=torch.float64) * 2, logits


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 6), st.integers(1, 3), st.integers(0, 10**6))
def test_diagonal_scales_equal_mixture_same_family(B, M, C, D, seed):
    "Eq. (7.1') in the mixture: MixtureSameFamily of Independent Normals with one σ per coordinate."
    x, presence, means, scales, logits = _diagonal(B, M, C, D, seed)
    mix = MixtureSameFamily(Categorical(logits=logits), Independent(Normal(means, scales), 1))
    expected = (mix.log_prob(x.transpose(0, 1)).transpose(0, 1) * presence).sum(1)
    torch.testing.assert_close(gmm_log_likelihood(x, presence, means, scales, logits), expected)
    ref = Independent(Normal(means[:, None], scales[:, None]), 1).log_prob(x[:, :, None])     # [B, M, C]
    torch.testing.assert_close(gaussian_log_density(x, means, scales), ref)


@pytest.mark.parametrize("D", [1, 2, 3, 5])
def test_equal_diagonal_scales_are_the_isotropic_mixture(D):
    x, presence, means, scales, logits = _random(B=4, M=9, C=6, D=D, seed=D)
    diag = scales[..., None].expand(-1, -1, D)
    for bg in (None, 0.01):
        torch.testing.assert_close(gmm_log_joint(x, presence, means, diag, logits, background=bg),
                                   gmm_log_joint(x, presence, means, scales, logits, background=bg))
        torch.testing.assert_close(gmm_posterior(x, presence, means, diag, logits, background=bg),
                                   gmm_posterior(x, presence, means, scales, logits, background=bg))


def test_isotropic_path_is_eq_7_1_written_out_bit_for_bit():
    "The CCAE's path: the values and gradients of Eq. (7.1) as one line, exactly."
    x, presence, means, scales, logits = (t.float() if t.is_floating_point() else t for t in _random(B=4, M=11, C=12))
    presence[0] = False
    leaves = [t.clone().requires_grad_() for t in (x, means, scales, logits)]
    x_, m_, s_, l_ = leaves
    joint = gmm_log_joint(x_, presence, m_, s_, l_)
    x0 = torch.where(presence[..., None], x_, torch.zeros(()))
    s0 = torch.where(presence.any(1, keepdim=True), s_, torch.ones(()))
    sq = (x0[:, :, None, :] - m_[:, None, :, :]).pow(2).sum(-1)
    lam = s0[:, None, :]
    written = torch.log_softmax(l_, -1)[:, None, :] + (-0.5 * 2 * math.log(2 * math.pi) - 2 * torch.log(lam)
                                                       - sq / (2 * lam**2))
    assert torch.equal(joint, written)
    for a, b in zip(torch.autograd.grad(joint.exp().sum(), leaves), torch.autograd.grad(written.exp().sum(), leaves)):
        assert torch.equal(a, b)


def test_diagonal_scales_shape_and_values_checked():
    x, presence, means, scales, logits = _diagonal(B=3, M=7, C=5, D=2)
    with pytest.raises(ValueError, match=r"scales must have shape \(3, 5\) or \(3, 5, 2\) .*got \(3, 5, 3\)$"):
        gmm_log_likelihood(x, presence, means, torch.ones(3, 5, 3, dtype=x.dtype), logits)
    presence[1, 0] = True
    bad = scales.clone()
    bad[1, 2, 1] = -1.0
    with pytest.raises(ValueError, match=r"^scales must be positive and finite .*scales\[1, 2, 1\] = -1"):
        gmm_log_likelihood(x, presence, means, bad, logits)
    with pytest.raises(ValueError, match=r"scales\[1, 2, 1\] = -1"):
        gaussian_log_density(x, means, bad)


def test_an_empty_example_uses_none_of_its_diagonal_scales():
    x, presence, means, scales, logits = _diagonal(B=3)
    presence[1] = False
    presence[0, 0] = presence[2, 0] = True
    bad = scales.clone()
    bad[1] = float("nan")
    bad[1, 0, 0] = 0.0
    bad.requires_grad_()
    ll = gmm_log_likelihood(x, presence, means, bad, logits)
    (g_scales,) = torch.autograd.grad(ll.sum(), bad)
    assert ll[1] == 0 and (g_scales[1] == 0).all() and torch.isfinite(g_scales).all()
    torch.testing.assert_close(ll, gmm_log_likelihood(x, presence, means, scales, logits), rtol=0, atol=0)


def test_a_nan_or_infinite_point_is_refused_by_its_example():
    x, presence, means, scales, logits = _random(B=4, M=6)
    presence[:, 0] = True
    for value in (float("nan"), float("inf")):
        bad = x.clone()
        bad[2, 0, 1] = value
        for f in (gmm_log_likelihood, gmm_posterior, gmm_log_joint):
            with pytest.raises(ValueError, match=r"^x must be finite, the present points at least; example\(s\) \[2\] "
                                                 r"hold NaN or inf$"):
                f(bad, presence, means, scales, logits)
        with pytest.raises(ValueError, match=r"example\(s\) \[2\]"):
            gaussian_log_density(bad, means, scales)
