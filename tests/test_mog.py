"""The mixture-of-Gaussians experiment of Chapter 5b: the task, exact resume through the engine, the command line."""
import json

import pytest
import torch

from capsule_book.cli import main
from capsule_book.mog import (MOG_MODELS, DeepSet, MogConfig, evaluate_mog, load_mog, mog_benchmark, mog_model,
                              parse_mog, train_mog)
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
