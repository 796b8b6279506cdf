"""The mixture-of-Gaussians experiment of Chapter 5b: the task, exact resume through the engine, the command line."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from capsule_book.cli import main
from capsule_book.mog import (MOG_MODELS, DeepSet, MogConfig, evaluate_mog, load_mog, mog_benchmark, mog_log_prob,
                              mog_model, mog_nll, parse_mog, plot_mog_fits, sample_mog, train_mog)
from capsule_book.utils import round_off as _round_off
from capsule_book.train import CheckpointError, load_checkpoint

TINY = dict(dim=16, n_heads=2, n_inducing=4, n_min=20, n_max=40, eval_batches=2, steps=10, decay_step=6,
            log_every=2, eval_every=5, progress=False, device="cpu")


@pytest.mark.parametrize("name", MOG_MODELS)
def test_each_model_resumes_bit_exactly_and_learns(tmp_path, name):
    whole = train_mog(MogConfig(model=name, out=str(tmp_path / "a"), **TINY))
    part = train_mog(MogConfig(model=name, out=str(tmp_path / "b"), stop_at=3, **TINY))
    rest = train_mog(MogConfig(model=name, out=str(tmp_path / "b"), resume=True, **TINY))
    assert part.step == 3 and not part.finished and rest.finished
    assert all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), rest.model.parameters()))
    assert [r["step"] for r in rest.history] == [2, 4, 5, 6, 8, 10]
    assert [r["lr"] for r in whole.history] == [1e-3, 1e-3, 1e-3, 1e-3, 1e-4, 1e-4]   # η(s): ÷10 from step 6
    assert whole.history[-1]["eval_ll"] == rest.history[-1]["eval_ll"] > whole.history[2]["eval_ll"] - 1.0


def test_another_model_or_setting_is_refused_by_name(tmp_path):
    train_mog(MogConfig(model="sab-pma", out=str(tmp_path), **{**TINY, "steps": 2}))
    with pytest.raises(CheckpointError, match=r"model='sab-pma'.*model='isab-pma'"):
        train_mog(MogConfig(model="isab-pma", out=str(tmp_path), resume=True, **{**TINY, "steps": 4}))
    with pytest.raises(CheckpointError, match=r"n_max=40.*n_max=50"):
        train_mog(MogConfig(model="sab-pma", out=str(tmp_path), resume=True, **{**TINY, "steps": 4, "n_max": 50}))


def test_models_are_permutation_invariant_and_write_mixtures():
    X = torch.randn(3, 30, 2)
    perm = torch.randperm(30)
    for name in MOG_MODELS:
        torch.manual_seed(0)
        net = mog_model(dict(model=name, dim=16, n_heads=2, n_inducing=4, k=4)).eval()
        with torch.no_grad():
            out = net(X)
            torch.testing.assert_close(net(X[:, perm]), out, rtol=1e-5, atol=1e-5 * out.abs().max().item())
        pi, mu, sig = parse_mog(out)
        torch.testing.assert_close(pi.sum(-1), torch.ones(3))
        assert (sig > 0).all() and mu.shape == (3, 4, 2)
    assert isinstance(mog_model(dict(model="rff-pooling", dim=16, n_heads=2, n_inducing=4, k=4)), DeepSet)
    with pytest.raises(ValueError, match="model must be one of"):
        mog_model(dict(model="lstm", dim=16, n_heads=2, n_inducing=4, k=4))


def test_benchmark_is_fixed_and_its_oracle_is_the_papers():
    sets, oracle = mog_benchmark(n_batches=20)
    again, oracle2 = mog_benchmark(n_batches=20)
    assert oracle == oracle2 and all(torch.equal(a, b) for a, b in zip(sets, again))
    assert all(100 <= X.shape[1] <= 500 and X.shape[0] == 10 for X in sets)
    assert abs(oracle - (-1.4726)) < 0.05        # the paper's oracle, within the sampling error of 200 sets


def test_command_line_train_and_eval(tmp_path, capsys):
    small = ["--dim", "16", "--n-heads", "2", "--n-min", "20", "--n-max", "40", "--eval-batches", "2",
             "--steps", "4", "--eval-every", "2", "--no-progress", "--device", "cpu", "--out", str(tmp_path)]
    assert main(["train", "mog", "--model", "isab-pma", "--n-inducing", "4", *small]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", "mog", "--checkpoint", str(tmp_path / "last.pt"), "--eval-batches", "2"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ll"] == pytest.approx(trained["eval_ll"], abs=1e-6) and (res["n_min"], res["n_max"]) == (20, 40)
    model, ck = load_mog(tmp_path / "last.pt")
    sets, _ = mog_benchmark(2, n_min=20, n_max=40)
    assert evaluate_mog(model, sets) == pytest.approx(res["ll"], abs=1e-6) and ck["config"]["model"] == "isab-pma"


def test_without_layer_norm_from_the_command_line_to_the_loaded_model(tmp_path, capsys):
    "--no-layer-norm reaches the run's config and the loaded model; a config without `ln` means LayerNorm."
    small = ["--dim", "16", "--n-heads", "2", "--n-min", "20", "--n-max", "40", "--eval-batches", "2",
             "--steps", "2", "--eval-every", "2", "--no-progress", "--device", "cpu", "--out", str(tmp_path)]
    assert main(["train", "mog", "--model", "sab-pma", "--no-layer-norm", *small]) == 0
    capsys.readouterr()
    model, ck = load_mog(tmp_path / "last.pt")
    assert ck["config"]["ln"] is False
    norms = lambda m: sum(isinstance(x, torch.nn.LayerNorm) for x in m.modules())
    assert norms(model) == 0
    old = {k: v for k, v in ck["config"].items() if k != "ln"}          # a run from before the flag
    assert norms(mog_model(old)) == 2 * 4 and norms(mog_model({**old, "model": "isab-pma"})) == 2 * 6
    with pytest.raises(CheckpointError, match="ln"):                    # resuming with LayerNorm: refused
        train_mog(MogConfig(model="sab-pma", out=str(tmp_path), resume=True,
                            **{**TINY, "dim": 16, "steps": 4}))


def test_attention_scale_of_the_authors_from_the_command_line_to_the_loaded_model(tmp_path, capsys):
    "--attention-scale width divides the scores by √d, as the authors' code; absent from a config: √(d/h)."
    from capsule_book.set_transformer import Multihead, attention
    torch.manual_seed(0)
    Q, K, V = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 3)
    torch.testing.assert_close(attention(Q, K, V, scale_dim=32),
                               (Q @ K.transpose(1, 2) / math.sqrt(32)).softmax(-1) @ V)
    # the fused kernel (from 2^16 scores per head) and the line-by-line heads agree on the scale
    mh = Multihead(4, 4, 16, 4)
    mh.scale_dim = 16
    X, mask = torch.randn(1, 300, 4), torch.rand(1, 300) < 0.8
    fused = mh(X, X, X, mask)
    mh.fused = False
    torch.testing.assert_close(fused, mh(X, X, X, mask), rtol=1e-4, atol=1e-5)
    mh.scale_dim = None
    assert (mh(X, X, X, mask) - fused).abs().max() > 1e-3          # √(d/h) is another function
    small = ["--dim", "16", "--n-heads", "2", "--n-min", "20", "--n-max", "40", "--eval-batches", "2",
             "--steps", "2", "--eval-every", "2", "--no-progress", "--device", "cpu", "--out", str(tmp_path)]
    assert main(["train", "mog", "--model", "sab-pma", "--attention-scale", "width", *small]) == 0
    capsys.readouterr()
    model, ck = load_mog(tmp_path / "last.pt")
    assert ck["config"]["scale"] == "width"
    heads = lambda m: [x.scale_dim for x in m.modules() if isinstance(x, Multihead)]
    assert heads(model) == [16] * 4                                  # 2 SABs, PMA, the SAB after it
    old = {k: v for k, v in ck["config"].items() if k != "scale"}     # a run from before the flag
    assert heads(mog_model(old)) == [None] * 4
    with pytest.raises(ValueError, match="scale must be"):
        mog_model({**old, "scale": "wide"})
    with pytest.raises(CheckpointError, match="scale"):              # resuming with √(d/h): refused
        train_mog(MogConfig(model="sab-pma", out=str(tmp_path), resume=True,
                            **{**TINY, "dim": 16, "steps": 4}))


def test_mixture_density_integrates_to_one_and_matches_torch_distributions():
    g = torch.Generator().manual_seed(3)
    X, _, (pi, mu, sig) = sample_mog(3, 50, generator=g)
    sig = sig * torch.rand(3, 4, 2, generator=g).add(0.5)              # unequal scales too
    grid = torch.linspace(-7, 7, 701)
    pts = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(1, -1, 2).expand(3, -1, -1)
    mass = mog_log_prob(pts, pi, mu, sig).exp().sum(1) * (grid[1] - grid[0]) ** 2
    # a Riemann sum with spacing 0.02 ≪ σ ≥ 0.15 and the square ±7 ⊃ μ ± 6σ: exact but for the float32 round-off
    # of the sum of 701² densities (and of each density, relative |log p| ε ≤ 10ε where the mass is)
    torch.testing.assert_close(mass, torch.ones(3), rtol=0, atol=_round_off(torch.ones(1), 10 * pts.shape[1]))
    D = torch.distributions
    ref = D.MixtureSameFamily(D.Categorical(pi), D.Independent(D.Normal(mu, sig), 1))
    want = ref.log_prob(X.transpose(0, 1)).T
    n = 2 * 4 + 4                                        # D·k terms, then the log-sum-exp over k
    torch.testing.assert_close(mog_log_prob(X, pi, mu, sig), want, rtol=0, atol=_round_off(want, n))


def test_sampler_follows_the_generative_process():
    g = torch.Generator().manual_seed(4)
    X, labels, (pi, mu, sig) = sample_mog(2000, 200, generator=g)
    assert ((mu >= -4) & (mu <= 4)).all() and (sig == 0.3).all()
    torch.testing.assert_close(pi.mean(0), torch.full((4,), 0.25), atol=0.02, rtol=0)   # Dirichlet(1): E π = 1/4
    torch.testing.assert_close(pi.var(0), torch.full((4,), 3 / 80), atol=0.005, rtol=0)  # Var = (K-1)/(K²(K+1))
    resid = (X - mu.gather(1, labels.unsqueeze(-1).expand(-1, -1, 2))) / 0.3
    assert abs(resid.std().item() - 1) < 0.01 and abs(resid.mean().item()) < 0.01
    freq = F.one_hot(labels, 4).float().mean(1)                                          # label frequencies ≈ π
    assert (freq - pi).abs().mean() < 0.03


def test_oracle_beats_wrong_parameters_and_loss_is_minus_ll():
    g = torch.Generator().manual_seed(5)
    X, _, (pi, mu, sig) = sample_mog(4, 300, generator=g)
    truth = mog_log_prob(X, pi, mu, sig).mean()
    assert truth > mog_log_prob(X, pi, mu + 0.5, sig).mean()
    assert truth > mog_log_prob(X, pi, mu, sig * 2).mean()
    raw = torch.cat([pi.log().unsqueeze(-1), mu, torch.log(torch.expm1(sig - 1e-6))], -1)  # inverse of parse_mog
    p2, m2, s2 = parse_mog(raw)
    torch.testing.assert_close(p2, pi, rtol=0, atol=_round_off(pi, 4))                  # softmax of k = 4 logits
    assert torch.equal(m2, mu)
    torch.testing.assert_close(s2, sig, rtol=0, atol=_round_off(sig, 3))                # expm1, log, softplus
    lp = mog_log_prob(X, pi, mu, sig)
    n = 2 * 4 + lp.numel()                                                              # D·k terms, then the mean
    torch.testing.assert_close(mog_nll(raw, X), -truth, rtol=0, atol=_round_off(lp, n))
    mask = torch.rand(4, 300, generator=g) < 0.5
    expected = -mog_log_prob(X, p2, m2, s2)[mask].mean()
    torch.testing.assert_close(mog_nll(raw, X, mask), expected, rtol=0, atol=_round_off(lp, n))


def test_far_points_have_finite_loss_and_gradient():
    raw = torch.zeros(1, 4, 5, requires_grad=True)
    X = torch.full((1, 3, 2), 50.0)
    loss = mog_nll(raw, X)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(raw.grad).all()


def test_a_few_training_steps_improve_the_held_out_likelihood_and_the_plot():
    sets, oracle = mog_benchmark(n_batches=2, batch=4, n_min=50, n_max=80)
    cfg = MogConfig(model="isab-pma", dim=16, n_heads=2, n_inducing=4, batch_size=4, n_min=50, n_max=80,
                    eval_batches=2, steps=20, eval_every=0, progress=False, device="cpu")
    before = evaluate_mog(mog_model({k: getattr(cfg, k) for k in ("model", "dim", "n_heads", "n_inducing", "k")}), sets)
    model = train_mog(cfg).model
    after = evaluate_mog(model, sets)
    assert after > before and after < oracle + 0.1
    fig = plot_mog_fits(model, sets[0][:3], ncols=2)
    assert len([ax for ax in fig.axes if ax.axison]) == 3
    assert len(fig.axes[0].patches) == 4 * 2                                  # 4 components × (1σ, 2σ)


def test_log_prob_is_chapter_7s_mixture_and_eq_5b1_written_out():
    "mog_log_prob is logsumexp of gmm_log_joint (diagonal scales, log π floored at 1e-30), and Eq. (5b.1) in log space."
    from capsule_book.gmm import gmm_log_joint
    g = torch.Generator().manual_seed(6)
    X, _, (pi, mu, sig) = sample_mog(5, 200, generator=g)
    sig = sig * torch.rand(5, 4, 2, generator=g).add(0.5)
    pi[:, 3] = 0.0                                                                      # a weight under the floor
    pi = pi / pi.sum(-1, keepdim=True)
    lp = mog_log_prob(X, pi, mu, sig)
    assert lp.shape == (5, 200)
    joint = gmm_log_joint(X, torch.ones(5, 200, dtype=torch.bool), mu, sig, pi.clamp_min(1e-30).log())
    assert torch.equal(lp, torch.logsumexp(joint, -1))
    x, m, s = X.unsqueeze(2), mu.unsqueeze(1), sig.unsqueeze(1)
    log_n = (-0.5 * math.log(2 * math.pi) - s.log() - 0.5 * ((x - m) / s) ** 2).sum(-1)
    written = torch.logsumexp(log_n + pi.clamp_min(1e-30).log().unsqueeze(1), -1)
    torch.testing.assert_close(lp, written, rtol=0, atol=_round_off(written, 2 * 4 + 4))
    with pytest.raises(ValueError, match="scales must be positive and finite"):
        mog_log_prob(X, pi, mu, sig.neg())


def test_the_deepset_refuses_what_the_set_transformers_refuse():
    torch.manual_seed(0)
    X = torch.randn(3, 12, 2)
    for net in (mog_model({"model": "rff-pooling", "dim": 16, "k": 4, "n_heads": 2, "n_inducing": 4}),
                mog_model({"model": "sab-pma", "dim": 16, "k": 4, "n_heads": 2, "n_inducing": 4})):
        for value in (float("nan"), float("inf")):
            bad = X.clone()
            bad[1, 4, 0] = value
            with pytest.raises(ValueError, match=r"^X must be finite.*; set\(s\) \[1\] hold NaN or inf$"):
                net(bad)
        with pytest.raises(ValueError, match=r"every set needs at least one present element; X has shape \[3, 0, 2\]"):
            net(X[:, :0])
        with pytest.raises(ValueError, match=r"^X must be a batch of sets \[B, n, 2\], got shape \[3, 12, 3\]$"):
            net(torch.randn(3, 12, 3))
        assert net(X).shape == (3, 4, 5)


def test_mog_nll_refuses_nan_points():
    X, _, (pi, mu, sig) = sample_mog(2, 20, generator=torch.Generator().manual_seed(0))
    raw = torch.cat([pi.log()[..., None], mu, torch.log(torch.expm1(sig - 1e-6))], -1)     # parse_mog's inverse
    assert math.isfinite(mog_nll(raw, X).item())
    X[1, 7, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^x must be finite.*example\(s\) \[1\] hold NaN or inf$"):
        mog_nll(raw, X)
