"""The Set Transformer of Lee et al. 2019 (chapter 5), checked on the installed package."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from capsule_book.set_transformer import ISAB, MAB, PMA, SAB, Multihead, SetTransformer, attention
from capsule_book.utils import round_off

TOL = dict(atol=1e-5, rtol=1e-5)                         # float64 blocks: 1e-5 is 10¹¹ times their round-off
EPS32 = torch.finfo(torch.float32).eps


_round_off = round_off                                  # c·ε·√n·max|scale| (capsule_book.utils)


def _seeded(seed, module):
    torch.manual_seed(seed)
    return module().double().eval()


@functools.lru_cache(maxsize=None)
def _blocks(seed):
    "One of each block, in float64, with random weights."
    return dict(sab=_seeded(seed, lambda: SAB(3, 16, 4)),
                isab=_seeded(seed, lambda: ISAB(3, 16, 4, n_inducing=5)),
                pma=_seeded(seed, lambda: PMA(3 * 4, 4, n_seeds=3)),
                st_sab=_seeded(seed, lambda: SetTransformer(3, 5, 4, dim=16, n_heads=4)),
                st_isab=_seeded(seed, lambda: SetTransformer(3, 5, 4, dim=16, n_heads=4, n_inducing=6)))


sets = st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(0, 10_000))


def _perm_and_set(data, B, n, seed, width):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, n, width, generator=g, dtype=torch.float64) * 2
    perm = torch.tensor(data.draw(st.permutations(range(n))))
    return X, perm


@settings(max_examples=25, deadline=None)
@given(sets, st.data())
def test_sab_isab_are_permutation_equivariant(shape, data):
    B, n, seed = shape
    X, perm = _perm_and_set(data, B, n, seed, 3)
    for name in ("sab", "isab"):
        block = _blocks(seed % 7)[name]
        torch.testing.assert_close(block(X[:, perm]), block(X)[:, perm], **TOL)


@settings(max_examples=25, deadline=None)
@given(sets, st.data())
def test_pma_and_set_transformer_are_permutation_invariant(shape, data):
    B, n, seed = shape
    blocks = _blocks(seed % 7)
    Z, perm = _perm_and_set(data, B, n, seed, 12)
    torch.testing.assert_close(blocks["pma"](Z[:, perm]), blocks["pma"](Z), **TOL)
    X = Z[..., :3]
    for name in ("st_sab", "st_isab"):
        torch.testing.assert_close(blocks[name](X[:, perm]), blocks[name](X), **TOL)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 10), st.integers(0, 10_000), st.floats(-1e4, 1e4, allow_nan=False))
def test_masked_out_elements_do_not_change_the_output(n, seed, junk):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(2, n, 3, generator=g, dtype=torch.float64)
    mask = torch.rand(2, n, generator=g) < 0.6
    mask[:, 0] = True                                    # at least one present element per set
    X2 = X.clone()
    X2[~mask] = junk                                     # whatever the absent elements hold
    X3 = X.clone()
    X3[~mask] = torch.randn(int((~mask).sum()), 3, generator=g, dtype=torch.float64) * 100
    for name, block in _blocks(seed % 5).items():
        Xb = torch.cat([X, X, X, X], -1) if name == "pma" else X
        X2b = torch.cat([X2, X2, X2, X2], -1) if name == "pma" else X2
        X3b = torch.cat([X3, X3, X3, X3], -1) if name == "pma" else X3
        ref = block(Xb, mask)
        torch.testing.assert_close(block(X2b, mask), ref, **TOL)
        torch.testing.assert_close(block(X3b, mask), ref, **TOL)


@pytest.mark.parametrize("name", ["sab", "isab", "pma", "st_sab", "st_isab"])
def test_padding_with_absent_elements_changes_nothing(name):
    block = _blocks(3)[name]
    width = 12 if name == "pma" else 3
    X = torch.randn(2, 7, width, dtype=torch.float64)
    X_pad = torch.cat([X, torch.randn(2, 4, width, dtype=torch.float64) * 50], 1)
    present = (torch.arange(11) < 7).expand(2, 11)
    out, out_pad = block(X), block(X_pad, present)
    if name in ("sab", "isab"):                          # equivariant: compare the present rows; absent rows are 0
        torch.testing.assert_close(out_pad[:, :7], out, **TOL)
        assert (out_pad[:, 7:] == 0).all()
    else:
        torch.testing.assert_close(out_pad, out, **TOL)


def test_sets_of_different_sizes_in_one_batch():
    "A padded batch of two sets of sizes 5 and 9 gives each set's own output."
    model = _blocks(1)["st_isab"]
    A, B = torch.randn(1, 5, 3, dtype=torch.float64), torch.randn(1, 9, 3, dtype=torch.float64)
    batch = torch.cat([torch.cat([A, torch.zeros(1, 4, 3, dtype=torch.float64)], 1), B])
    mask = torch.stack([torch.arange(9) < 5, torch.ones(9, dtype=torch.bool)])
    out = model(batch, mask)
    torch.testing.assert_close(out[0], model(A)[0], **TOL)
    torch.testing.assert_close(out[1], model(B)[0], **TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_equals_torch_sdpa_on_the_same_projections(masked):
    torch.manual_seed(0)
    mh = Multihead(dim_q=5, dim_kv=7, dim=24, n_heads=3)
    X, Y = torch.randn(4, 6, 5), torch.randn(4, 9, 7)
    mask = torch.rand(4, 9) < 0.5 if masked else None
    if masked:
        mask[:, 2] = True
    Qh, Kh, Vh = mh.heads(X, Y, Y)
    ours = attention(Qh, Kh, Vh, None if mask is None else mask[:, None, :])
    ref = F.scaled_dot_product_attention(Qh, Kh, Vh, attn_mask=None if mask is None else mask[:, None, None, :])
    n = 24 // 3 + 9                                      # QKᵀ sums d/h terms, ωV sums m; a convex mix of V's size
    torch.testing.assert_close(ours, ref, rtol=0, atol=_round_off(Vh, n))
    # and the whole of Eq. (2): concat of the heads, then W^O (24 more terms)
    want = mh.W_O(ref.transpose(1, 2).flatten(-2))
    torch.testing.assert_close(mh(X, Y, Y, mask), want, rtol=0, atol=_round_off(want, n + 24))


def test_mab_is_eqs_4_and_5():
    "MAB(X, Y) = LN(H + rFF(H)), H = LN(X + Multihead(X, Y, Y)), computed by hand from the block's weights."
    torch.manual_seed(1)
    mab = MAB(8, 5, 8, n_heads=2).double()
    X, Y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 6, 5, dtype=torch.float64)
    Qh, Kh, Vh = mab.multihead.heads(X, Y, Y)
    O = ((Qh @ Kh.transpose(-2, -1)) / math.sqrt(8 / 2)).softmax(-1) @ Vh       # scale √(d/h)
    H = F.layer_norm(X + mab.multihead.W_O(O.transpose(1, 2).flatten(-2)), (8,),
                     mab.ln0.weight, mab.ln0.bias)                                # Eq. (5), residual on X itself
    r = mab.rff
    expected = F.layer_norm(H + r[2](F.relu(r[0](H))), (8,), mab.ln1.weight, mab.ln1.bias)   # Eq. (4)
    torch.testing.assert_close(mab(X, Y), expected)


def test_ln_false_turns_layernorm_off():
    torch.manual_seed(2)
    on, off = MAB(4, 4, 8, 2, ln=True), MAB(4, 4, 8, 2, ln=False)
    off.load_state_dict({k: v for k, v in on.state_dict().items() if not k.startswith("ln")})
    X = torch.randn(2, 5, 4) * 3
    y_on, y_off = on(X, X), off(X, X)
    torch.testing.assert_close(y_on.mean(-1), torch.zeros(2, 5), rtol=0, atol=_round_off(y_on, 8))  # mean of 8
    # LayerNorm divides by √(var + 1e-5), not √var: the std falls short of 1 by 1e-5 / (2 var), var ≥ 0.005 here
    torch.testing.assert_close(y_on.std(-1, unbiased=False), torch.ones(2, 5), atol=1e-3, rtol=0)
    assert y_off.mean(-1).abs().max() > 1e-2                       # not normalised


def _n_scores(block, n, width=3):
    block(torch.randn(1, n, width, dtype=torch.float64))
    return sum(m.n_scores for m in block.modules() if isinstance(m, MAB))


def test_isab_cost_is_linear_and_sab_cost_quadratic_in_n():
    blocks = _blocks(0)
    m, h = 5, 4
    for n in (10, 20, 40, 80, 160):
        assert _n_scores(blocks["isab"], n) == 2 * h * m * n         # Eq. (8) m·n, Eq. (7) n·m, per head
        assert _n_scores(blocks["sab"], n) == h * n * n
    counts = [_n_scores(blocks["isab"], n) for n in (100, 200, 400)]
    assert counts[1] == 2 * counts[0] and counts[2] == 2 * counts[1]


def test_lemma1_attention_with_equal_keys_is_the_mean():
    V = torch.randn(2, 7, 3)
    out = attention(torch.randn(2, 4, 5), torch.ones(2, 7, 5), V)
    torch.testing.assert_close(out, V.mean(1, keepdim=True).expand(2, 4, 3))


@pytest.mark.parametrize("make, match", [
    (lambda: MAB(3, 3, 10, n_heads=4), "multiple of n_heads"),
    (lambda: SAB(3, 30, n_heads=4), "multiple of n_heads"),
    (lambda: SetTransformer(2, 5, 4, dim=30, n_heads=4), "multiple of n_heads"),
])
def test_dim_not_divisible_by_heads_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mismatched_shapes_are_refused_with_the_shapes():
    mab = MAB(3, 5, 8, 2)
    with pytest.raises(ValueError, match=r"\[B, n, 3\].*\[2, 4, 4\]"):
        mab(torch.randn(2, 4, 4), torch.randn(2, 6, 5))
    with pytest.raises(ValueError, match=r"\[B, n, 5\].*\[2, 6, 3\]"):
        mab(torch.randn(2, 4, 3), torch.randn(2, 6, 3))
    with pytest.raises(ValueError, match="same number of sets"):
        mab(torch.randn(2, 4, 3), torch.randn(3, 6, 5))
    with pytest.raises(ValueError, match=r"\[2, 6\].*\[2, 5\]"):
        mab(torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        mab(torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"set\(s\) \[1\]"):
        mab(torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.tensor([[True] * 6, [False] * 6]))
    model = SetTransformer(2, 5, 4, dim=16)
    with pytest.raises(ValueError, match=r"\[B, n, 2\].*\[10, 2\]"):
        model(torch.randn(10, 2))


@pytest.mark.parametrize("name", ["sab", "isab", "pma", "st_sab", "st_isab", "mab"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused_naming_the_set(name, value):
    block = MAB(3, 3, 16, 4).double() if name == "mab" else _blocks(0)[name]
    X = torch.randn(4, 6, 12 if name == "pma" else 3, dtype=torch.float64)
    X[2, 5, 1] = value
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2, 5] = False                                   # an absent element too: 0 · NaN = NaN
    args = (X, X) if name == "mab" else (X,)
    for m in (None, mask):
        with pytest.raises(ValueError, match=r"must be finite.*set\(s\) \[2\] hold NaN or inf"):
            block(*args, m)
    if name == "mab":                                    # the keys alone
        with pytest.raises(ValueError, match=r"^Y must be finite.*\[2\]"):
            block(torch.randn(4, 2, 3, dtype=torch.float64), X)


def test_a_large_finite_input_is_accepted_even_where_its_sum_overflows():
    from capsule_book.set_transformer import _check_set
    _check_set("X", torch.full((2, 5, 2), 3e38), 2)     # finite, but its sum is inf: the exact check decides
    many = torch.randn(12, 3, 2)
    many[:, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"set\(s\) \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, … \(12 in all\)\]"):
        SetTransformer(2, 5, 4, dim=16, n_heads=2)(many)


@pytest.mark.parametrize("name", ["sab", "isab", "pma", "st_sab", "st_isab"])
def test_an_empty_set_is_refused_like_an_all_masked_one(name):
    block = _blocks(0)[name]
    width = 12 if name == "pma" else 3
    with pytest.raises(ValueError, match=r"every set needs at least one present element; X has shape \[2, 0, 3\], "
                                         r"so all 2 sets are empty" if width == 3 else r"every set needs at least one "
                                         r"present element; Z has shape \[2, 0, 12\]"):
        block(torch.zeros(2, 0, width, dtype=torch.float64))
    mask = torch.tensor([[True, True, False], [False, False, False]])
    with pytest.raises(ValueError, match=r"every set needs at least one present element; set\(s\) \[1\] have none"):
        block(torch.randn(2, 3, width, dtype=torch.float64), mask)
    assert block(torch.zeros(0, 3, width, dtype=torch.float64)).shape[0] == 0   # no set at all is no empty set


# Eqs. (5.1)-(5.2): attention regrouped so that the projections act on the short side


@pytest.mark.parametrize("case", ["few queries", "few queries, masked", "shared queries", "few queries, y_map",
                                  "few keys"])
def test_regrouped_attention_is_eqs_1_to_3_in_value_and_every_gradient(case):
    from capsule_book.set_transformer import attend_few_keys, attend_few_queries
    torch.manual_seed(3)
    mh = Multihead(dim_q=6, dim_kv=5, dim=12, n_heads=3).double()
    mh.fused = False                                     # the reference: Eqs. (1)-(3) line by line
    few_keys = case == "few keys"
    n, m = (30, 4) if few_keys else (3, 30)
    X = torch.randn(2 if case != "shared queries" else 1, n, 6, dtype=torch.float64, requires_grad=True)
    Y = torch.randn(2, m, 5, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(2, m) < 0.6) | (torch.arange(m) == 0) if case.endswith("masked") else None
    W2 = torch.nn.Linear(5, 5).double() if case.endswith("y_map") else None
    Yk = Y if W2 is None else W2(Y)
    ref = mh(X.expand(2, -1, -1), Yk, Yk, mask)
    out = attend_few_keys(mh, X, Y) if few_keys else attend_few_queries(mh, X, Y, mask, W2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    params = [X, Y, *mh.parameters(), *([] if W2 is None else W2.parameters())]
    g = torch.randn_like(ref)
    for a, b, p in zip(torch.autograd.grad(ref, params, g, allow_unused=True),
                       torch.autograd.grad(out, params, g, allow_unused=True), params):
        if b is None:                                    # only b^K of the few-queries form: it cancels
            assert not few_keys and p is mh.W_K.bias and a.abs().max() < 1e-12
        else:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_written_out_backwards_pass_gradcheck():
    from capsule_book.set_transformer import _FewKeys, _FewQueries
    torch.manual_seed(4)
    d = dict(dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False, True, False], [True, False, False, False, False]])
    assert torch.autograd.gradcheck(lambda G, Y: _FewQueries.apply(G, Y, mask),
                                    (torch.randn(1, 4, 3, **d), torch.randn(2, 5, 3, **d)))
    assert torch.autograd.gradcheck(lambda G, Y: _FewQueries.apply(G, Y, None),
                                    (torch.randn(2, 4, 3, **d), torch.randn(2, 5, 3, **d)))
    assert torch.autograd.gradcheck(lambda X, G, c, U: _FewKeys.apply(X, G, c, U, 2),
                                    (torch.randn(2, 5, 3, **d), torch.randn(2, 6, 3, **d), torch.randn(2, 6, **d),
                                     torch.randn(2, 6, 4, **d)))


def test_plan_regroups_where_it_saves_multiply_adds_and_torch_counts_the_saving():
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(5)
    isab = ISAB(128, 128, 4, n_inducing=16)              # the recipe's second ISAB(16) at n = 450
    assert isab.mab0.multihead.plan(16, 450) == "few queries" and isab.mab1.multihead.plan(450, 16) == "few keys"
    assert Multihead(128, 128, 128, 4).plan(450, 450) == "heads"
    X = torch.randn(2, 450, 128)
    flops = {}
    for fused in (False, True):
        for mod in isab.modules():
            if isinstance(mod, Multihead):
                mod.fused = fused
        with FlopCounterMode(display=False) as fc:
            out = isab(X)
        flops[fused] = fc.get_total_flops()
        if not fused:
            ref = out
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # per set: Q, K, V, W^O on 450 rows and 2·450·16·128 for each attention, against 2·(450·128·64) each MAB
    assert flops[True] < 0.75 * flops[False], flops


@pytest.mark.parametrize("kind", ["isab16", "isab32-noln", "sab-width"])
def test_fused_set_transformer_trains_like_the_line_by_line_one_in_float32(kind):
    "Loss and every gradient of the whole model, masked batch: the regrouped blocks are the same function."
    torch.manual_seed(6)
    n_inducing = None if kind.startswith("sab") else int(kind[4:6])
    models = []
    for fused in (True, False):
        torch.manual_seed(6)
        net = SetTransformer(2, 5, 4, dim=64, n_heads=4, n_layers=2, n_inducing=n_inducing, ln="noln" not in kind)
        for mod in net.modules():
            if isinstance(mod, Multihead):
                mod.fused = fused
                mod.scale_dim = mod.dim if kind.endswith("width") else None
        models.append(net)
    X = torch.randn(3, 200, 2) * 2
    mask = torch.arange(200) < torch.tensor([[200], [150], [37]])
    losses, grads = [], []
    for net in models:
        out = net(X, mask)
        loss = out.square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad for k, p in net.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    for k, g in grads[1].items():
        if k.endswith("W_K.bias"):                       # its true gradient is 0: cancels in every softmax
            assert g.abs().max() < 1e-4 * max(v.abs().max() for v in grads[1].values())
            continue
        torch.testing.assert_close(grads[0][k], g, rtol=0, atol=1e-4 * g.abs().max().item() + 1e-7, msg=k)
