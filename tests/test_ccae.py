"""The Constellation Capsule Autoencoder of Chapter 8: the accuracy metric, the model's mathematics, training."""
import io
import itertools
import math

import pytest
import torch

from capsule_book.train import CheckpointError, UserError
from capsule_book.ccae import (CCAE, BatchLinear, evaluate_ccae, geometric_transform, segmentation_accuracy, train_ccae)
from capsule_book.constellations import make_constellations
from capsule_book.gmm import gmm_log_likelihood, gmm_posterior

Y = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]])
ALL = torch.ones_like(Y, dtype=torch.bool)


@pytest.mark.parametrize("perm", [[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 1, 0]])
def test_perfect_segmentation_under_any_relabelling(perm):
    assert segmentation_accuracy(torch.tensor(perm)[Y], Y, ALL) == 1.0


def test_one_mistake_and_absent_points():
    a = Y.clone()
    a[0, 4] = 0  # a triangle point given to the first square's capsule
    assert segmentation_accuracy(a, Y, ALL) == pytest.approx(10 / 11)
    pres = ALL.clone()
    pres[0, 4] = False  # the mistaken point is absent: not counted at all
    assert segmentation_accuracy(a, Y, pres) == 1.0


def test_one_capsule_for_everything_gets_largest_object():
    assert segmentation_accuracy(torch.zeros_like(Y), Y, ALL) == pytest.approx(4 / 11)


def test_matching_is_one_to_one_not_majority():
    # capsule 0 explains both squares: only one square can be matched to it
    a = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]])
    assert segmentation_accuracy(a, Y, ALL) == pytest.approx(7 / 11)


def test_matching_is_per_example_and_pooled_over_points():
    y = torch.cat([Y, Y])
    a = torch.cat([Y, torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0]])])  # second relabelled: still perfect
    assert segmentation_accuracy(a, y, torch.ones_like(y, dtype=torch.bool)) == 1.0
    pres = torch.ones_like(y, dtype=torch.bool)
    pres[1, :7] = False  # second example: only one object present, its 4 points right
    a2 = torch.cat([torch.zeros_like(Y), a[1:]])
    assert segmentation_accuracy(a2, y, pres) == pytest.approx((4 + 4) / (11 + 4))


def test_unused_capsule_labels_are_matched():
    # capsules 0 and 2 only: the official np.unique-sized matrix would miss capsule 2
    gt = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    pred = torch.tensor([[0, 0, 0, 0, 2, 2, 2]])
    assert segmentation_accuracy(pred, gt, torch.ones_like(gt, dtype=torch.bool)) == 1.0


def test_more_capsules_than_objects():
    a = torch.tensor([[5, 5, 5, 5, 3, 3, 3, 4, 4, 4, 1]])
    assert segmentation_accuracy(a, Y, ALL, n_capsules=6) == pytest.approx(10 / 11)


def test_no_present_point_is_nan_and_shapes_checked():
    assert math.isnan(segmentation_accuracy(Y, Y, torch.zeros_like(ALL)))
    with pytest.raises(ValueError, match=r"\[B, M\]"):
        segmentation_accuracy(Y[0], Y, ALL)


def test_batch_linear_is_one_linear_per_capsule():
    bl = BatchLinear(4, 6, 3)
    x = torch.randn(5, 4, 6)
    for k in range(4):
        torch.testing.assert_close(bl(x)[:, k], x[:, k] @ bl.weight[k] + bl.bias[k])
    with pytest.raises(ValueError, match=r"\[B, 4, 6\]"):
        bl(torch.randn(5, 3, 6))


def test_geometric_transform_similarity_and_affine():
    p = torch.randn(500, 6)
    T = geometric_transform(p, similarity=True)
    A = T[:, :2, :2]
    s2 = torch.linalg.det(A)  # similarity: A = sR, det = s² > 0, AAᵀ = s²I
    torch.testing.assert_close(A @ A.transpose(1, 2), s2[:, None, None] * torch.eye(2).expand(500, 2, 2),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2.sqrt(), torch.sigmoid(p[:, 0]) + 1e-2)
    torch.testing.assert_close(T[:, :2, 2], torch.tanh(5 * p[:, 4:6]))
    Ta = geometric_transform(p, similarity=False)
    assert (Ta[:, 2] == torch.tensor([0.0, 0.0, 1.0])).all()
    # zero shear and equal scales: the affine form reduces to the similarity
    q = p.clone()
    q[:, 1], q[:, 3] = q[:, 0], 0.0
    torch.testing.assert_close(geometric_transform(q, False), geometric_transform(q, True))


@pytest.fixture(scope="module")
def model_and_batch():
    torch.manual_seed(0)
    model = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=32).eval()
    batch = make_constellations(48, generator=torch.Generator().manual_seed(1))
    return model, batch


def test_log_likelihood_is_the_votes_mixture(model_and_batch):
    model, b = model_and_batch
    out = model(b.points, b.presence)
    B, K, N = 48, 3, 4
    ref = gmm_log_likelihood(b.points, b.presence, out.votes.reshape(B, K * N, 2), out.scales.reshape(B, K * N),
                             out.vote_presence.reshape(B, K * N).log())
    torch.testing.assert_close(out.log_likelihood, ref, atol=1e-4, rtol=1e-5)
    assert (out.vote_presence <= out.object_presence[..., None] + 1e-6).all()  # a_k a_kn ≤ a_k
    assert (out.scales[b.presence.any(1)] > 1e-2).all()  # λ = softplus(·) + 0.01 (empty examples: zeros)


def test_assignment_is_capsule_of_best_vote(model_and_batch):
    model, b = model_and_batch
    out = model(b.points, b.presence)
    ref = out.posterior.argmax(-1) // 4
    assert torch.equal(out.assignment[b.presence], ref[b.presence])


def test_empty_examples_and_absent_points(model_and_batch):
    model, b = model_and_batch
    empty = ~b.presence.any(1)
    assert empty.any()  # one in eight examples; this batch has some
    out = model(b.points, b.presence)
    assert (out.log_likelihood[empty] == 0).all() and (out.assignment[empty] == 0).all()
    keep = ~empty
    sub = model(b.points[keep], b.presence[keep])
    torch.testing.assert_close(out.log_likelihood[keep], sub.log_likelihood)
    torch.testing.assert_close(out.loss, sub.loss)
    junk = b.points.clone()
    junk[~b.presence] = 3.0
    torch.testing.assert_close(model(junk, b.presence).log_likelihood, out.log_likelihood, atol=1e-5, rtol=1e-5)


def test_permutation_invariant(model_and_batch):
    model, b = model_and_batch
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    out, out_p = model(b.points, b.presence), model(b.points[:, perm], b.presence[:, perm])
    torch.testing.assert_close(out_p.votes, out.votes, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_p.log_likelihood, out.log_likelihood, atol=1e-4, rtol=1e-5)


def test_losses_match_their_definitions(model_and_batch):
    model, b = model_and_batch
    keep = b.presence.any(1)
    out = model(b.points[keep], b.presence[keep])
    B = int(keep.sum())
    u = out.vote_presence.max(-1).values
    torch.testing.assert_close(out.losses["prior_within"], ((u.sum(1) - 1.5) ** 2).mean())
    torch.testing.assert_close(out.losses["prior_between"], ((u.sum(0) - B / 2) ** 2).mean())
    torch.testing.assert_close(out.losses["nll"], -out.log_likelihood.mean())
    w = model.weights
    total = out.losses["nll"] + sum(w[k] * v for k, v in out.losses.items() if k != "nll")
    torch.testing.assert_close(out.loss, total)


def test_bad_inputs_and_weights_refused():
    with pytest.raises(ValueError, match="unknown loss weights"):
        CCAE(dim=16, n_layers=1, weights={"sparsity": 1.0})
    m = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16)
    with pytest.raises(ValueError, match=r"\[B, M, 2\]"):
        m(torch.randn(2, 5, 3), torch.ones(2, 5, dtype=torch.bool))


def test_training_lowers_the_loss_and_gradients_finite():
    torch.manual_seed(0)
    model = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=32)
    hist = train_ccae(model, 80, batch_size=16, lr=3e-3, optimizer="adam", log_every=20, progress=False).history
    assert hist[-1]["nll"] < hist[0]["nll"] - 1.0
    assert all(math.isfinite(r["loss"]) for r in hist)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoint_resume_is_exact(tmp_path):
    def fresh():
        torch.manual_seed(0)
        return CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16)
    kw = dict(batch_size=8, lr=1e-3, optimizer="adam", log_every=3, progress=False)
    a = fresh()
    train_ccae(a, 6, **kw)
    b = fresh()
    train_ccae(b, 6, out=tmp_path, stop_at=4, checkpoint_every=2, **kw)          # stopped inside a chunk
    c = fresh()
    torch.manual_seed(123)  # resuming must not depend on the state the caller left
    hist = train_ccae(c, 6, out=tmp_path, resume=True, **kw).history
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)                                                    # bit-identical
    assert [r["step"] for r in hist] == [3, 6]


def test_figures_draw_points_and_votes(model_and_batch):
    import matplotlib
    matplotlib.use("Agg")
    from capsule_book.ccae import plot_ccae, plot_ccae_history
    model, b = model_and_batch
    i = int(b.presence.any(1).nonzero()[0])
    sub = type(b)(*(t[i:i + 2] for t in b))
    out = model(sub.points, sub.presence)
    fig = plot_ccae(sub, out, n_examples=2)
    top, bottom = fig.axes[0], fig.axes[2]  # 2 x 2 grid, row-major
    assert len(top.collections[0].get_offsets()) == int(sub.presence[0].sum())
    assert len(bottom.collections) == 1 + 3 * 4  # the points, then one marker per vote
    assert len(bottom.patches) == 3 * 4  # one circle of radius λ per vote
    hist = [{"step": s, "nll": 1.0 / s, "loss": 1.0, "train_accuracy": 0.5} for s in (1, 2, 3)]
    fig = plot_ccae_history({"a": hist, "b": hist})
    assert len(fig.axes[0].lines) == 2


def test_command_line_train_resume_eval(tmp_path, capsys):
    import json
    from capsule_book import cli
    from capsule_book.ccae import load_ccae
    small = ["--batch-size", "8", "--dim", "16", "--n-layers", "1", "--n-heads", "2", "--out", str(tmp_path),
             "--no-progress", "--device", "cpu", "--eval-n", "50"]
    assert cli.main(["train", "ccae", "--steps", "2", *small]) == 0
    assert cli.main(["train", "ccae", "--steps", "4", "--resume", *small]) == 0
    model, ck = load_ccae(tmp_path / "last.pt")
    assert ck["step"] == 4 and model.config["dim"] == 16
    capsys.readouterr()
    assert cli.main(["eval", "ccae", "--checkpoint", str(tmp_path / "last.pt"), "--n", "100", "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["step"] == 4 and 0.0 <= res["accuracy"] <= 1.0 and res["n"] == 100


def test_evaluate_reports_the_one_capsule_floor_counted_by_hand():
    torch.manual_seed(0)
    model = CCAE(dim=16, n_layers=1, n_heads=2)
    res = evaluate_ccae(model, n=200, batch_size=2)                  # one chunk of 200 constellations, seed 12345
    data = make_constellations(200, generator=torch.Generator().manual_seed(12345))
    largest = [max(((data.pattern_id[b] == k) & data.presence[b].bool()).sum().item() for k in range(3))
               for b in range(200)]                                  # one capsule can win at most the largest object
    assert abs(res["one_capsule_baseline"] - sum(largest) / data.presence.sum().item()) < 1e-9
    assert 0.5 < res["one_capsule_baseline"] < 0.7
    with torch.no_grad():                                            # the same constellations, split by objects present
        out = model.eval()(data.points, data.presence)
    n_obj = [len(set(data.pattern_id[b][data.presence[b].bool()].tolist())) for b in range(200)]
    for c in (1, 2, 3):
        sel = [b for b in range(200) if n_obj[b] == c]
        assert len(sel) > 10
        correct = total = 0
        for b in sel:                                                # the best of the 3! capsule maps, by brute force
            pres = data.presence[b].bool()
            y, a_ = data.pattern_id[b][pres].tolist(), out.assignment[b][pres].tolist()
            correct += max(sum(perm[j] == k for j, k in zip(y, a_)) for perm in itertools.permutations(range(3)))
            total += len(y)
        assert abs(res[f"accuracy_{c}_objects"] - correct / total) < 1e-9
        assert abs(res[f"one_capsule_baseline_{c}_objects"] - sum(largest[b] for b in sel) / total) < 1e-9
    assert res["one_capsule_baseline_1_objects"] == 1.0                  # one object: one capsule is right
    assert res["accuracy_1_objects"] != res["accuracy_3_objects"]


def test_official_encoder_ignores_order_and_absent_points():
    from capsule_book.ccae import OfficialCapsuleEncoder
    torch.manual_seed(0)
    enc = OfficialCapsuleEncoder(3, 8, dim=16, n_heads=2, n_layers=2)
    X, mask = torch.randn(5, 11, 2), torch.rand(5, 11) < 0.6
    mask[:, 0] = True
    c = enc(X, mask)
    perm = torch.randperm(11)
    torch.testing.assert_close(enc(X[:, perm], mask[:, perm]), c, atol=1e-5, rtol=1e-5)
    junk = X.clone()
    junk[~mask] = 50.0
    torch.testing.assert_close(enc(junk, mask), c)
    assert not torch.allclose(c[:, 0], c[:, 1])                          # the queries read out different capsules
    with pytest.raises(ValueError, match="multiples of n_heads"):
        OfficialCapsuleEncoder(3, 10, dim=16, n_heads=4)


def test_official_model_uses_the_background_component():
    from capsule_book.ccae import OFFICIAL_MODEL
    torch.manual_seed(0)
    model = CCAE(**{**OFFICIAL_MODEL, "dim": 16, "n_heads": 2, "n_layers": 1}).eval()
    b = make_constellations(32, generator=torch.Generator().manual_seed(2))
    out = model(b.points, b.presence)
    B, K, N = 32, 3, 4
    args = (b.points, b.presence, out.votes.reshape(B, K * N, 2), out.scales.reshape(B, K * N),
            out.vote_presence.reshape(B, K * N).log())
    torch.testing.assert_close(out.log_likelihood, gmm_log_likelihood(*args, background=0.01), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(out.log_likelihood, gmm_log_likelihood(*args), atol=1e-3)
    assert torch.equal(out.assignment[b.presence], (out.posterior.argmax(-1) // N)[b.presence])
    torch.testing.assert_close(out.posterior, gmm_posterior(*args, background=0.01), atol=1e-5, rtol=1e-4)
    far = b.points + 20.0                                                # points no vote covers: the background's
    out_far = model(far, b.presence)                                     # share is left out of the posterior
    args_far = (far, b.presence, out_far.votes.reshape(B, K * N, 2), out_far.scales.reshape(B, K * N),
                out_far.vote_presence.reshape(B, K * N).log())
    torch.testing.assert_close(out_far.posterior, gmm_posterior(*args_far, background=0.01), atol=1e-5, rtol=1e-4)
    assert (out_far.posterior.sum(-1)[b.presence] < 0.5).all()
    torch.testing.assert_close(gmm_posterior(*args_far).sum(-1)[b.presence], torch.ones(int(b.presence.sum())))
    with pytest.raises(ValueError, match="encoder must be"):
        CCAE(dim=16, n_layers=1, encoder="pma")
    with pytest.raises(ValueError, match="background must be a positive"):
        CCAE(dim=16, n_layers=1, background=0.0)


def test_load_ccae_refuses_other_checkpoints_by_name(tmp_path):
    from capsule_book.ccae import load_ccae
    from capsule_book.train import save_checkpoint
    save_checkpoint({"task": "capsnet", "model": {}, "config": {}, "step": 3}, tmp_path / "capsnet.pt")
    with pytest.raises(UserError, match="holds a capsnet checkpoint, not a CCAE one"):
        load_ccae(tmp_path / "capsnet.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="junk.pt is not a readable checkpoint"):
        load_ccae(tmp_path / "junk.pt")


def test_template_init_sets_the_range_of_the_static_part_poses():
    torch.manual_seed(0)
    official = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16).op_static.detach()
    torch.manual_seed(0)
    narrow = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16, template_init=0.1).op_static.detach()
    assert 0.4 < official.abs().max() <= 0.45 and 0.09 < narrow.abs().max() <= 0.1
    torch.testing.assert_close(narrow, official * (0.1 / 0.45))           # the same draws, scaled
    translations = torch.tanh(5 * official[..., 4:])                    # the official init: near tanh's saturation
    assert (translations.abs() > 0.9).float().mean() > 0.2
    assert (torch.tanh(5 * narrow[..., 4:]).abs() < 0.47).all()
    with pytest.raises(ValueError, match="template_init must be positive"):
        CCAE(dim=16, n_heads=2, n_layers=1, template_init=0.0)


def test_resuming_with_another_model_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    ck = tmp_path / "last.pt"
    train_ccae(CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16), 2, batch_size=8, out=tmp_path, progress=False)
    other = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16, encoder="official", background=0.01)
    with pytest.raises(CheckpointError, match=r"encoder': 'set_transformer'.*encoder': 'official'"):
        train_ccae(other, 4, batch_size=8, out=tmp_path, resume=True, progress=False)


def test_learning_rate_decays_as_the_official_exponential_decay(tmp_path):
    torch.manual_seed(0)
    ck = tmp_path / "last.pt"
    model = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16)
    train_ccae(model, 6, batch_size=8, lr=1e-3, out=tmp_path, progress=False, lr_decay=0.5, decay_steps=2)
    saved = torch.load(ck, weights_only=False)
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 * 0.5 ** (5 / 2))   # the 6th step: step 5
    assert (saved["config"]["lr"], saved["config"]["lr_decay"], saved["config"]["decay_steps"]) == (1e-3, 0.5, 2)
    with pytest.raises(CheckpointError, match="lr_decay"):
        train_ccae(model, 8, batch_size=8, lr=1e-3, out=tmp_path, resume=True, progress=False)    # another schedule
    with pytest.raises(ValueError, match=r"lr_decay must lie in \(0, 1\]"):
        train_ccae(model, 2, batch_size=8, lr_decay=1.5, progress=False)


def test_command_line_defaults_build_the_official_model():
    import argparse
    from capsule_book.ccae import OFFICIAL_MODEL, OFFICIAL_TEMPLATE_INIT
    from capsule_book.cli import ccae_from_args, ccae_train_arguments
    p = argparse.ArgumentParser()
    ccae_train_arguments(p)
    config = ccae_from_args(p.parse_args([])).config
    assert {k: config[k] for k in OFFICIAL_MODEL} == OFFICIAL_MODEL
    # the command line imports no torch for --help, so it types the official value: the same
    assert config["template_init"] == OFFICIAL_TEMPLATE_INIT
    assert ccae_from_args(p.parse_args(["--background", "0"])).background is None


def test_static_part_presence_is_one_learned_logit_per_capsule_part():
    torch.manual_seed(0)
    model = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16, part_presence="static")
    with torch.no_grad():
        model.bias[:, 7:7 + model.N] = torch.linspace(-2, 2, model.K * model.N).view(model.K, model.N)
    b = make_constellations(6, generator=torch.Generator().manual_seed(1), drop_prob=0.0)
    out = model.eval()(b.points, b.presence)
    a_kn = out.vote_presence / out.object_presence[..., None]                  # [B, K, N]
    expected = torch.sigmoid(model.bias[:, 7:7 + model.N]).expand_as(a_kn)      # the same in every example
    torch.testing.assert_close(a_kn, expected)
    # the decoded logits of h_part's last layer get no gradient; the dynamic model's do
    model.train()(b.points, b.presence).loss.backward()
    last = model.h_part[-1].weight.grad                                        # [K, d, 8N+7]
    N = model.N
    assert last[..., 6 * N + 7:7 * N + 7].abs().max() == 0 and last[..., :6 * N].abs().max() > 0
    dynamic = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16)
    dynamic(b.points, b.presence).loss.backward()
    assert dynamic.h_part[-1].weight.grad[..., 6 * N + 7:7 * N + 7].abs().max() > 0
    with pytest.raises(ValueError, match="part_presence must be 'dynamic' or 'static'"):
        CCAE(part_presence="learned")


def test_complete_steps_train_on_complete_constellations_first(tmp_path):
    from capsule_book.ccae import ccae_task
    torch.manual_seed(0)
    model = CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16)
    task = ccae_task(model, batch_size=8, complete_steps=200, drop_prob=0.3)
    batches = [next(task.stream) for _ in range(400)]
    assert all(bool(b.presence.all()) for b in batches[:200])                 # chunks 0 and 1: complete
    dropped = torch.stack([1 - b.presence.float().mean() for b in batches[200:]]).mean()
    # a pattern is 4, 3 or 4 of 11 points; dropped with probability 0.3
    assert abs(dropped.item() - 0.3) < 0.03
    assert task.config["complete_steps"] == 200 and task.config["drop_prob"] == 0.3
    for bad in (dict(complete_steps=150), dict(drop_prob=1.0)):
        with pytest.raises(ValueError):
            ccae_task(model, **bad)
    # resumed inside the first chunk after the switch: the same weights as one run
    def fresh():
        torch.manual_seed(0)
        return CCAE(dim=16, n_heads=2, n_layers=1, n_hidden=16, part_presence="static")
    kw = dict(batch_size=8, lr=1e-3, optimizer="adam", log_every=50, progress=False, complete_steps=100)
    a = fresh(); train_ccae(a, 130, **kw)
    b = fresh(); train_ccae(b, 130, out=tmp_path, stop_at=110, **kw)
    c = fresh(); train_ccae(c, 130, out=tmp_path, resume=True, **kw)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_competitive_readout_shares_each_point_among_the_capsules():
    from capsule_book.ccae import OfficialCapsuleEncoder, competitive_attention
    torch.manual_seed(0)
    Q, K, V = torch.randn(2, 3, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 5)
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    out = competitive_attention(Q, K, V, mask)
    # by hand with loops: r_km = softmax over capsules, then a weighted mean over present points
    for b in range(2):
        for k in range(3):
            r = [math.exp(Q[b, k] @ K[b, m] / 2) / sum(math.exp(Q[b, j] @ K[b, m] / 2) for j in range(3))
                 for m in range(7)]
            w = [r[m] * bool(mask[b, m]) for m in range(7)]
            expected = sum(w[m] * V[b, m] for m in range(7)) / sum(w)
            torch.testing.assert_close(out[b, k], expected, atol=1e-5, rtol=1e-5)
    # a point's shares over the capsules sum to one: a capsule that takes a point takes it from the others
    r = torch.softmax(Q @ K.transpose(1, 2) / 2, dim=1)                       # [2, 3, 7]
    torch.testing.assert_close(r.sum(1), torch.ones(2, 7))
    enc = OfficialCapsuleEncoder(3, 8, dim=16, n_heads=2, n_layers=1, readout="competitive")
    att = OfficialCapsuleEncoder(3, 8, dim=16, n_heads=2, n_layers=1)
    att.load_state_dict(enc.state_dict())                      # the same parameters, another readout
    X, m = torch.randn(4, 11, 2), torch.rand(4, 11) < 0.6
    m[:, 0] = True
    c = enc(X, m)
    assert not torch.allclose(c, att(X, m), atol=1e-3)
    perm = torch.randperm(11)
    torch.testing.assert_close(enc(X[:, perm], m[:, perm]), c, atol=1e-5, rtol=1e-5)
    Xj = X.clone(); Xj[~m] = 100.0
    torch.testing.assert_close(enc(Xj, m), c, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="readout must be"):
        OfficialCapsuleEncoder(3, 8, readout="softmax")
    with pytest.raises(ValueError, match="needs encoder='official'"):
        CCAE(dim=16, n_heads=2, n_layers=1, readout="competitive")


def test_part_noise_and_deformations_switch_off_what_they_name():
    from capsule_book.ccae import capsule_votes
    torch.manual_seed(0)
    K, N, B = 3, 4, 5
    raw, bias, op = torch.randn(B, K, 8 * N + 7), torch.randn(K, 2 * N + 7), torch.randn(K, N, 6)
    quiet = capsule_votes(raw, bias, op, static_parts=True)
    torch.manual_seed(1)
    noisy = capsule_votes(raw, bias, op, noise_scale=4.0, static_parts=True, part_noise=False)
    # noise on ℓ_k only: log a_k,n is the static logit's in every example
    torch.testing.assert_close(noisy.log_a - torch.nn.functional.logsigmoid(noisy.l_k),
                               quiet.log_a - torch.nn.functional.logsigmoid(quiet.l_k))
    assert (noisy.l_k - quiet.l_k).abs().max() > 0.1 and (noisy.l_k - quiet.l_k).abs().max() <= 2
    torch.manual_seed(1)
    both = capsule_votes(raw, bias, op, noise_scale=4.0, static_parts=True)
    assert not torch.allclose(both.log_a, noisy.log_a)
    rigid = capsule_votes(raw, bias, op, deformations=False)
    # OP_k,n = T(static): the votes of a raw output with its dynamic part zeroed
    raw0 = raw.clone(); raw0[..., :6 * N] = 0
    torch.testing.assert_close(rigid.mu, capsule_votes(raw0, bias, op).mu)
    assert rigid.op_dynamic.abs().max() == 0 and not torch.allclose(rigid.mu, quiet.mu)


def test_command_line_builds_the_books_ccae():
    import argparse
    import sys
    from pathlib import Path
    from capsule_book.cli import ccae_from_args, ccae_train_arguments, ccae_train_settings
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from ccae_ablation import BOOK, CONFIGS
    p = argparse.ArgumentParser()
    ccae_train_arguments(p)
    args = p.parse_args(BOOK)
    model = ccae_from_args(args)
    # the official training noise on the part presences is kept
    assert model.static_parts and model.part_noise and not model.deformations
    # the official readout is kept too; the competitive readout (Eq. 8.1) is measured, not kept
    assert model.encoder.readout_kind == "attention"
    assert ccae_from_args(p.parse_args(CONFIGS["book + competitive readout"])).encoder.readout_kind \
        == "competitive"
    assert model.weights["prior_within"] == model.weights["prior_between"] == 0
    assert ccae_train_settings(args)["drop_prob"] == 0.2 and ccae_train_settings(args)["average"] == 0.999
    # the official configuration undoes all of them
    official = p.parse_args(CONFIGS["official"])
    assert ccae_train_settings(official)["average"] == 0 and ccae_train_settings(official)["drop_prob"] == 0.5
    official = ccae_from_args(official)
    assert official.part_noise and official.deformations and not official.static_parts
    assert official.encoder.readout_kind == "attention" and official.weights["prior_within"] == 1
    # "book, X" undoes the one change X
    from ccae_ablation import CHANGES
    for name, undone in CHANGES.items():
        assert [a for a in BOOK if a not in CONFIGS[f"book, {name}"]] == undone
    # every configuration is told apart by its arguments, in any order (the result file names rows so)
    from ccae_ablation import config_of
    assert all(config_of(list(reversed(args)) if not args else args[2:] + args[:2]) == name
               for name, args in CONFIGS.items())


def _official_small(**kw):
    torch.manual_seed(0)
    return CCAE(dim=16, n_heads=2, n_layers=2, n_hidden=16, dim_special=8, encoder="official",
                background=0.01, **kw)


def test_present_rows_encoder_is_the_padded_encoder():
    "The packed layers give the padded layers' loss and every gradient, on batches with absent points."
    model = _official_small()
    batch = make_constellations(16, generator=torch.Generator().manual_seed(3))
    assert not batch.presence.all()                        # absent points, and some empty examples
    results = {}
    for packed in (True, False):
        model.encoder.packed = packed
        model.zero_grad()
        torch.manual_seed(7)                               # the same training noise
        out = model(batch.points, batch.presence)
        out.loss.backward()
        results[packed] = out.loss.item(), {n: q.grad.clone() for n, q in model.named_parameters()}
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    for name, g in results[True][1].items():
        assert torch.allclose(g, results[False][1][name], rtol=1e-4, atol=1e-5), name
    # and the gradients are not all zero (the packed path reaches every encoder weight)
    assert all(g.abs().sum() > 0 for n, g in results[True][1].items() if n.startswith("encoder.sabs"))


def test_flat_rmsprop_makes_the_updates_of_rmsprop_and_resumes_exactly():
    from capsule_book.ccae import FlatRMSprop
    kw = dict(lr=1e-3, alpha=0.9, momentum=0.9, eps=0.1 / 8)
    batches = [make_constellations(8, generator=torch.Generator().manual_seed(s)) for s in range(6)]

    def train(model, opt, bs):
        for b in bs:
            opt.zero_grad()
            model(b.points, b.presence).loss.backward()
            opt.step()
    ref = _official_small(); ref_opt = torch.optim.RMSprop(ref.parameters(), **kw)
    flat = _official_small(); flat_opt = FlatRMSprop(flat, **kw)
    torch.manual_seed(1); train(ref, ref_opt, batches[:4])
    torch.manual_seed(1); train(flat, flat_opt, batches[:4])
    # trained: the weights moved
    assert not torch.equal(ref.encoder.embed.weight, _official_small().encoder.embed.weight)
    for (name, a), b in zip(ref.named_parameters(), flat.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
    # the parameters are still views of the flat tensor the optimiser updates
    assert all(q.untyped_storage().data_ptr() == flat_opt.flat.untyped_storage().data_ptr()
               for q in flat.parameters())
    flat_opt.zero_grad()
    assert all(q.grad is not None and not q.grad.any() for q in flat.parameters())
    # a copy resumed from a checkpoint (saved and loaded state dicts) continues as the original
    buf = io.BytesIO(); torch.save({"model": flat.state_dict(), "opt": flat_opt.state_dict()}, buf)
    buf.seek(0); ck = torch.load(buf)
    copy = _official_small(); copy_opt = FlatRMSprop(copy, **kw)
    copy.load_state_dict(ck["model"]); copy_opt.load_state_dict(ck["opt"])
    torch.manual_seed(2); train(flat, flat_opt, batches[4:])
    torch.manual_seed(2); train(copy, copy_opt, batches[4:])
    assert all(torch.equal(a, b) for a, b in zip(flat.parameters(), copy.parameters()))
    with pytest.raises(ValueError, match="share one dtype"):
        FlatRMSprop(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double()]))


def test_compiled_flat_rmsprop_is_rmsprop_and_compiles_once_for_any_learning_rate():
    "FlatRMSprop(compiled=True): torch's update to round-off, its state, and no new compile per η."
    from capsule_book.ccae import FlatRMSprop
    kw = dict(alpha=0.9, momentum=0.9, eps=0.1 / 8)
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    eager, compiled = net(), net()
    opts = FlatRMSprop(eager, lr=1e-3, **kw), FlatRMSprop(compiled, compiled=True, lr=1e-3, **kw)
    g = torch.Generator().manual_seed(3)
    for step, lr in enumerate([1e-3, 5e-4, 2e-4, 1e-4, 7e-5]):
        grad = torch.randn(opts[0].flat.shape, generator=g)
        for opt in opts:
            opt.param_groups[0]["lr"] = lr
            opt.flat.grad.copy_(grad)
            if step < 2:
                opt.step()
            else:                                  # compiled in the first steps: no compile after
                with torch.compiler.set_stance("fail_on_recompile"):
                    opt.step()
    # the weights moved, and moved alike: the parameters are views of the updated flat tensor
    assert not torch.equal(eager[0].weight, net()[0].weight)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    (se, sc) = (o.state[o.flat] for o in opts)
    assert set(sc) == set(se) and sc["step"].item() == se["step"].item() == 5
    for key in ("square_avg", "momentum_buffer"):
        assert torch.allclose(sc[key], se[key], rtol=1e-5, atol=1e-9)
    # its state is RMSprop's: an eager optimiser resumes it from a checkpoint
    buf = io.BytesIO(); torch.save({"model": compiled.state_dict(), "opt": opts[1].state_dict()}, buf)
    buf.seek(0); ck = torch.load(buf)
    resumed = net(); resumed_opt = FlatRMSprop(resumed, lr=7e-5, **kw)
    resumed.load_state_dict(ck["model"]); resumed_opt.load_state_dict(ck["opt"])
    grad = torch.randn(opts[0].flat.shape, generator=g)
    for opt in (opts[1], resumed_opt):
        opt.flat.grad.copy_(grad); opt.step()
    assert torch.allclose(resumed_opt.flat, opts[1].flat, rtol=1e-6, atol=1e-7)


_COMPILED_STEP_CHILD = """
import torch
from capsule_book.ccae import FlatRMSprop
from capsule_book.utils import inductor_cache_per_capability
torch.manual_seed(0); eager = torch.nn.Linear(7, 9)
torch.manual_seed(0); compiled = torch.nn.Linear(7, 9)
kw = dict(lr=1e-2, alpha=0.9, momentum=0.9, eps=1e-2)
opts = FlatRMSprop(eager, **kw), FlatRMSprop(compiled, compiled=True, **kw)
start = opts[0].flat.detach().clone()
for s in range(3):
    grad = torch.randn(opts[0].flat.shape, generator=torch.Generator().manual_seed(s))
    for o in opts:
        o.flat.grad.copy_(grad); o.step()
print(torch.backends.cpu.get_cpu_capability(), inductor_cache_per_capability(),
      (opts[0].flat - opts[1].flat).abs().max().item(), (opts[0].flat - start).abs().max().item())
"""


def test_compiled_step_is_right_under_each_cpu_capability_with_one_cache_folder(tmp_path):
    """Processes under different ATEN_CPU_CAPABILITY sharing TORCHINDUCTOR_CACHE_DIR: each compiles (or loads) its own
    code, and the compiled RMSProp step is the eager one (torch 2.14's cache alone reuses one capability's code in another)."""
    import os, subprocess, sys
    caps = ("avx2", None, "default")          # None: the CPU's own (avx512 where it has it)
    seen = []
    for cap in caps:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
        if cap: env["ATEN_CPU_CAPABILITY"] = cap
        out = subprocess.run([sys.executable, "-c", _COMPILED_STEP_CHILD], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        capability, folder, diff, moved = out.stdout.split()[-4:]
        assert folder == str(tmp_path / f"cpu-{capability.lower()}")
        assert float(moved) > 1e-2 and float(diff) <= 1e-6       # the weights moved, and alike
        seen.append(capability)
    assert seen[0] == "AVX2" and seen[2] == "DEFAULT"


def test_compiled_model_is_the_eager_model_in_training_and_evaluation():
    "model.compiled = True (torch.compile): the same loss, every gradient and the same training noise."
    eager, compiled = _official_small(), _official_small()
    compiled.compiled = True
    batches = [make_constellations(16, generator=torch.Generator().manual_seed(s)) for s in (0, 3)]
    # batches with a different number of non-empty examples: the compiled graph's sizes are symbolic
    assert len({int(b.presence.any(1).sum()) for b in batches}) == 2
    for training, batch in ((True, batches[0]), (True, batches[1]), (False, batches[1])):
        results = []
        for model in (eager, compiled):
            model.train(training)
            model.zero_grad()
            torch.manual_seed(7)                               # the same training noise
            out = model(batch.points, batch.presence)
            out.loss.backward()
            results.append((out.loss.item(), torch.cat([q.grad.flatten() for q in model.parameters()]),
                            torch.rand(1)))
        (loss_e, grad_e, after_e), (loss_c, grad_c, after_c) = results
        assert loss_c == pytest.approx(loss_e, rel=1e-5)
        assert (grad_c - grad_e).abs().max() <= 1e-5 * grad_e.abs().max()
        assert torch.equal(after_c, after_e)                   # as many random draws


def test_folded_first_sab_is_the_layer_as_written():
    "first_sab_on_present_rows (projections folded into the embedding) = SAB_1(embedding): output and every gradient."
    from capsule_book.ccae import OfficialCapsuleEncoder, first_sab_on_present_rows, sab_on_present_rows
    torch.manual_seed(0)
    enc = OfficialCapsuleEncoder(3, 32, dim=64, n_heads=4, n_layers=2)
    batch = make_constellations(16, generator=torch.Generator().manual_seed(3))
    X, mask = batch.points[batch.presence.any(1)], batch.presence[batch.presence.any(1)].bool()
    assert not mask.all()
    rows = mask.flatten().nonzero().squeeze(1)
    target = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(1))
    results = []
    for folded in (True, False):
        enc.zero_grad()
        h = (first_sab_on_present_rows(enc, X, rows, mask) if folded else
             sab_on_present_rows(enc.sabs[0], enc.embed(X.reshape(-1, 2)[rows]), rows, mask))
        (h * target).sum().backward()
        results.append((h.detach(), {n: torch.zeros_like(q) if q.grad is None else q.grad.clone()
                                     for n, q in enc.named_parameters()}))
    (h_f, g_f), (h_w, g_w) = results
    assert torch.allclose(h_f, h_w, rtol=1e-5, atol=1e-5)
    for name, g in g_w.items():
        if name.startswith("sabs.0") or name.startswith("embed"):
            # the gradient of the keys' bias is 0 in exact arithmetic (a constant per query row)
            assert torch.allclose(g_f[name], g, rtol=1e-4, atol=1e-5 * g_w[name].abs().max() + 1e-6), name
    assert g_w["embed.weight"].abs().sum() > 0 and g_f["embed.weight"].abs().sum() > 0


def test_presence_is_bool_or_0_1_and_nothing_else(model_and_batch):
    model, b = model_and_batch
    out = model(b.points, b.presence)
    as_float = model(b.points, b.presence.float())              # 0/1 read as False/True: the same output
    torch.testing.assert_close(as_float.log_likelihood, out.log_likelihood)
    half = b.presence.float()
    half[5, 3] = 0.5
    with pytest.raises(ValueError, match=r"^presence must be bool \(True = present\) or 0/1, got 0.5 in example\(s\) "
                                         r"\[5\]; a fraction is not read as a probability$"):
        model(b.points, half)


def test_loss_weights_must_be_finite_and_not_negative():
    for bad in ({"prior_within": float("nan")}, {"posterior_between": -5.0}, {"presence": float("inf")}):
        with pytest.raises(ValueError, match=r"^loss weights must be finite numbers >= 0, got \{'"):
            CCAE(dim=16, n_heads=2, n_layers=1, weights=bad)
    CCAE(dim=16, n_heads=2, n_layers=1, weights={"prior_within": 0.0, "posterior_between": 0.0})
