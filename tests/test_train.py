"""The one training engine (capsule_book.train) and the capsule-book command: exact resume for every model, clean
stops, refusals in one line, checkpoints that survive a crash, two processes under torchrun."""
import ast
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capsule_book.capsnet import CapsNet, TrainConfig, train_capsnet
from capsule_book.cli import main
from capsule_book.data import MNISTBatches, load_mnist, random_shift
from capsule_book.train import (CheckpointError, EpochStream, SyntheticStream, UserError, load_checkpoint,
                                save_checkpoint)

PACKAGE = Path(__file__).resolve().parent.parent / "capsule_book"
TINY = dict(limit_train=48, limit_test=32, batch_size=16, routing_iterations=1, eval_batch_size=32, progress=False,
            device="cpu", sample=True, log_every=1)
SMALL_CAPSNET = ["--limit-train", "32", "--limit-test", "32", "--batch-size", "16", "--routing-iterations", "1",
                 "--sample", "--device", "cpu", "--no-progress"]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_capsnet_stopped_inside_an_epoch_resumes_bit_exactly(tmp_path):
    straight = train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "a"), **TINY))      # 3 batches an epoch
    part = train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "b"), stop_at=4, **TINY))
    stopped = load_checkpoint(tmp_path / "b" / "last.pt")
    assert (part.step, part.finished) == (4, False) and stopped["stream"] == {"epoch": 1, "batch": 1}
    resumed = train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "b"), resume=True, **TINY))
    assert resumed.finished and same_weights(straight.model, resumed.model)
    rows = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))                       # one row per log step, no repeats
    drop = lambda r: {k: v for k, v in r.items() if k != "elapsed_s"}
    assert [drop(r) for r in rows] == [drop(r) for r in straight.history]      # the same metrics, value for value
    assert set(stopped) >= {"task", "config", "step", "model", "optimizer", "stream", "rng", "elapsed"}


def test_metrics_rows_after_the_last_checkpoint_are_not_repeated(tmp_path):
    train_capsnet(TrainConfig(epochs=2, out=str(tmp_path), stop_at=2, **TINY))
    with open(tmp_path / "metrics.jsonl", "a") as f:                           # a crash after a log row at step 3
        f.write(json.dumps({"step": 3, "loss": 9.9}) + "\n")
    train_capsnet(TrainConfig(epochs=2, out=str(tmp_path), resume=True, **TINY))
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"model": {}, "step": 1}, path)

    def crash(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"model": {}, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1          # the old checkpoint survives a crash while saving


def test_streams_resume_at_any_position():
    g = torch.Generator().manual_seed(0)
    x, y = load_mnist(False, limit=40, sample=True)
    for build in (lambda: EpochStream(MNISTBatches(x, y, 16, shuffle=True, max_shift=2, seed=3)),
                  lambda: SyntheticStream(lambda g: [torch.rand(2, generator=g) for _ in range(4)], seed=5)):
        for cut in (0, 1, 3, 4, 7):
            a = build()
            for _ in range(cut): next(a)
            b = build(); b.load_state_dict(a.state_dict())
            for _ in range(6):
                p, q = next(a), next(b)
                p, q = (p[0], q[0]) if isinstance(p, tuple) else (p, q)
                assert torch.equal(p, q), cut


def test_shift_and_sharding():
    x, y = load_mnist(False, limit=20, sample=True)
    g = torch.Generator().manual_seed(0)
    img = x[:4, None].float() / 255
    shifted = random_shift(img, 2, g)
    assert not torch.equal(shifted, img) and (shifted.sum((1, 2, 3)) <= img.sum((1, 2, 3)) + 1e-4).all()
    shards = [MNISTBatches(x, y, batch_size=3, shuffle=True, rank=r, world_size=3, pad=False) for r in range(3)]
    seen = sorted(i for s in shards for i in s.indices().tolist())
    assert seen == list(range(20))


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "Traceback" not in "\n".join(err), err
    return err[-1]


def test_bad_arguments_exit_2_in_one_line(capsys):
    cases = {("train", "capsnet", "--epochs", "-1"): "must be a positive integer",
             ("train", "no-such-model"): "invalid choice",
             ("eval", "capsnet"): "--checkpoint",
             ("train", "capsnet", "--routing-iterations", "three"): "must be a positive integer",
             ("train", "ccae", "--device", "cuda"): "not available here",
             ("train", "ccae", "--batch-size", "0"): "must be a positive integer",
             ("train", "ccae", "--steps", "0"): "must be a positive integer",
             ("train", "mog", "--max-minutes", "0"): "must be a positive number",
             ("train", "mog", "--n-min", "50", "--n-max", "10", "--steps", "1", "--out", "/nonexistent/x"): "n_min <= n_max",
             ("eval", "capsnet", "--checkpoint", "/nonexistent/last.pt"): "no checkpoint at /nonexistent/last.pt",
             ("eval", "mog", "--weights", "no-such-model"): "no shipped model 'no-such-model'"}
    for argv, words in cases.items():
        assert words in refused(list(argv), capsys), argv


def test_an_occupied_folder_a_foreign_or_broken_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "capsnet", "--steps", "2", "--out", str(run), *SMALL_CAPSNET]) == 0
    capsys.readouterr()
    line = refused(["train", "capsnet", "--steps", "4", "--out", str(run), *SMALL_CAPSNET], capsys)
    assert line.endswith(f"{run} already holds a run at step 2; pass --resume to continue it or choose another --out")
    assert "routing_iterations" in refused(["train", "capsnet", "--steps", "4", "--out", str(run), "--resume",
                                            *SMALL_CAPSNET[:-3], "--routing-iterations", "2", "--sample",
                                            "--device", "cpu"], capsys)            # another configuration
    assert "holds a capsnet run, not a ccae run" in refused(
        ["train", "ccae", "--steps", "4", "--resume", "--out", str(run), "--dim", "16", "--n-layers", "1"], capsys)
    assert "holds a capsnet checkpoint, not a CCAE one" in refused(
        ["eval", "ccae", "--checkpoint", str(run / "last.pt"), "--n", "10"], capsys)
    ccae = tmp_path / "ccae"
    assert main(["train", "ccae", "--steps", "1", "--out", str(ccae), "--dim", "16", "--n-layers", "1",
                 "--n-heads", "2", "--batch-size", "4", "--no-progress", "--eval-n", "10", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert "holds a ccae checkpoint, not a CapsNet one" in refused(
        ["eval", "capsnet", "--checkpoint", str(ccae / "last.pt"), "--sample"], capsys)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "last.pt").write_bytes((run / "last.pt").read_bytes()[:1000])       # truncated
    line = refused(["eval", "capsnet", "--checkpoint", str(broken / "last.pt"), "--sample"], capsys)
    assert f"{broken / 'last.pt'} is not a readable checkpoint" in line
    line = refused(["train", "capsnet", "--steps", "2", "--out", str(broken), *SMALL_CAPSNET], capsys)
    assert f"{broken / 'last.pt'} is not a readable checkpoint" in line      # read memory-mapped there
    assert "nothing to resume" in refused(["train", "capsnet", "--resume", "--out", str(tmp_path / "none"),
                                           *SMALL_CAPSNET], capsys)


def test_cli_train_stop_resume_then_eval(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "capsnet", "--epochs", "1", "--out", str(out), "--max-minutes", "0.0001", *SMALL_CAPSNET]
    assert main(argv) == 0                                          # a budget of 6 ms: the run stops early
    said = capsys.readouterr().out.strip().splitlines()
    step = load_checkpoint(out / "last.pt")["step"]
    assert said[0] == f"stopped at step {step} of 2; continue with `capsule-book {' '.join(argv)} --resume`"
    assert main(["train", "capsnet", "--epochs", "1", "--out", str(out), "--resume", *SMALL_CAPSNET]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", "capsnet", "--checkpoint", str(out / "last.pt"), "--limit-test", "32", "--sample"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["accuracy"] == trained["eval_accuracy"] and evaluated["step"] == 2


def test_cli_cooldown_goes_on_from_a_run_with_eta_down_to_zero(tmp_path, capsys):
    run, cool = tmp_path / "run", tmp_path / "cool"
    assert main(["train", "capsnet", "--epochs", "1", "--out", str(run), *SMALL_CAPSNET]) == 0      # 2 steps
    assert main(["train", "capsnet", "--epochs", "2", "--out", str(cool), "--log-every", "1",
                 "--cooldown-from", str(run / "last.pt"), *SMALL_CAPSNET]) == 0
    rows = [json.loads(l) for l in (cool / "metrics.jsonl").read_text().splitlines()]
    eta0 = 1e-3 * 0.96 ** (2 / 2000)                                  # Eq. (4.1) at the run's last step
    assert [r["lr"] for r in rows] == [eta0 * (1 - s / 4) for s in range(4)]
    assert [r["epoch"] for r in rows] == [1.5, 2.0, 2.5, 3.0]          # the run's data goes on
    ck = load_checkpoint(cool / "last.pt")
    assert (ck["config"]["cooldown_from_step"], ck["config"]["cooldown_steps"]) == (2, 4)
    capsys.readouterr()
    assert refused(["train", "capsnet", "--out", str(tmp_path / "x"), "--cooldown-from", str(run / "last.pt"),
                    *SMALL_CAPSNET, "--lr", "0.01"], capsys).endswith(
        f"{run / 'last.pt'} was trained with lr=0.001; this run asks for lr=0.01")
    assert "is a cooldown's checkpoint" in refused(
        ["train", "capsnet", "--out", str(tmp_path / "y"), "--cooldown-from", str(cool / "last.pt"), *SMALL_CAPSNET],
        capsys)
    assert "no checkpoint at /nonexistent/last.pt" in refused(
        ["train", "capsnet", "--out", str(tmp_path / "z"), "--cooldown-from", "/nonexistent/last.pt", *SMALL_CAPSNET],
        capsys)


def test_cli_cooldown_resumes_exactly_after_its_base_is_deleted(tmp_path, capsys):
    run, whole, cut = tmp_path / "run", tmp_path / "whole", tmp_path / "cut"
    assert main(["train", "capsnet", "--epochs", "1", "--out", str(run), *SMALL_CAPSNET]) == 0      # 2 steps
    cool = ["train", "capsnet", "--epochs", "2", "--log-every", "1", "--cooldown-from", str(run / "last.pt"),
            *SMALL_CAPSNET]
    assert main([*cool, "--out", str(whole)]) == 0
    assert main([*cool, "--out", str(cut), "--max-minutes", "0.0001"]) == 0      # stopped after its first step
    assert load_checkpoint(cut / "last.pt")["step"] < 4
    (run / "last.pt").unlink()                          # the cooldown's own checkpoint holds s0 and η(s0)
    assert main([*cool, "--out", str(cut), "--resume"]) == 0
    rows = {d: [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, cut)}
    assert [(r["step"], r["lr"], r["loss"]) for r in rows[cut]] == [(r["step"], r["lr"], r["loss"]) for r in rows[whole]]
    a, b = (load_checkpoint(d / "last.pt") for d in (whole, cut))
    assert a["step"] == b["step"] == 4 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_capsnet_refuses_integer_images():
    with pytest.raises(TypeError, match=r"float images in \[0, 1\].*images.float\(\) / 255"):
        CapsNet(1).eval()(torch.zeros(2, 1, 28, 28, dtype=torch.uint8))


def test_help_does_not_import_torch():
    probe = ("import sys, contextlib, io\nfrom capsule_book import cli\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    try: cli.main(['train', 'capsnet', '--help'])\n"
             "    except SystemExit: pass\nprint('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module: names.add(node.module)
        elif isinstance(node, ast.Import): names.update(a.name for a in node.names)
    return {n.split(".")[1] for n in names if n.startswith("capsule_book.")} | \
           {n for n in names if n in {"cli", "capsnet", "ccae", "mog"}}


def test_the_command_line_is_on_top_and_the_engine_knows_no_model():
    for module in PACKAGE.glob("*.py"):
        if module.stem != "cli":
            assert "cli" not in imports_of(module), f"{module.name} imports the command line"
    assert not imports_of(PACKAGE / "train.py") & {"capsnet", "ccae", "mog", "set_transformer", "weights"}


WORKER = """
import os, sys, torch
from capsule_book.capsnet import TrainConfig, train_capsnet
cfg = TrainConfig(epochs=1, out=sys.argv[1], limit_train=32, limit_test=32, batch_size=16, routing_iterations=1,
                  eval_batch_size=32, progress=False, device="cpu", sample=True, log_every=1)
result = train_capsnet(cfg)
torch.save(result.model.state_dict(), os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))
"""


def test_two_cpu_processes_with_gloo_end_identical(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                        f"--master_port={port}", str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    w0, w1 = (torch.load(tmp_path / f"rank{k}.pt") for k in (0, 1))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    ck = load_checkpoint(tmp_path / "last.pt")
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]                                   # 32 digits / (2 × 16): one step
    assert rows[0]["eval_n"] == 32 and ck["config"]["world_size"] == 2        # the test shards partition the set
    assert all(torch.equal(ck["model"][k], w0[k]) for k in w0)                # rank 0 saved the final weights


def test_moving_average_of_the_weights_is_evaluated_resumed_and_kept(tmp_path):
    from torch import nn
    from capsule_book.train import Task, fit, trained_weights

    def task(average: float) -> Task:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        def make(g): return [torch.randn(8, 3, generator=g) for _ in range(3)]
        def loss(net, x):
            err = (net(x) - x.sum(1, keepdim=True)).pow(2).mean()
            return err, {}
        return Task("toy", {"average": average}, model, torch.optim.SGD(model.parameters(), lr=0.1),
                    SyntheticStream(make, 0), loss, lambda s: 0.1,
                    evaluate=lambda m: {"w0": m.weight[0, 0].item()}, average=average)

    # the trained weights after 0, 1, ..., 6 steps, without an average
    live = [{k: v.clone() for k, v in task(0.0).model.state_dict().items()}]
    live += [{k: v.clone() for k, v in fit(task(0.0), n, progress=False).model.state_dict().items()}
             for n in range(1, 7)]
    d = 0.9
    by_hand = {k: v.clone() for k, v in live[0].items()}
    for w in live[1:]:
        by_hand = {k: d * by_hand[k] + (1 - d) * w[k] for k in w}
    run = fit(task(d), 6, out=tmp_path / "a", eval_every=6, progress=False)
    # the run ends with the average; its evaluation read the average; the checkpoint keeps both
    for k, v in run.model.state_dict().items():
        torch.testing.assert_close(v, by_hand[k])
    assert run.history[-1]["eval_w0"] == pytest.approx(by_hand["weight"][0, 0].item(), abs=1e-6)
    ck = load_checkpoint(tmp_path / "a" / "last.pt")
    assert torch.equal(ck["model"]["weight"], live[6]["weight"])
    assert not torch.allclose(ck["model"]["weight"], by_hand["weight"])
    # stopped and resumed: the same average, bit for bit
    fit(task(d), 6, out=tmp_path / "b", stop_at=3, progress=False)
    fit(task(d), 6, out=tmp_path / "b", resume=True, progress=False)
    cb = load_checkpoint(tmp_path / "b" / "last.pt")
    assert all(torch.equal(trained_weights(ck)[k], trained_weights(cb)[k]) for k in ck["model"])
    with pytest.raises(UserError, match="average must lie in"):
        fit(task(1.0), 1, progress=False)


def toy(loss_at=None, weight_at=None, kill_at=None, kills: int = 1) -> "Task":
    """A linear fit on a SyntheticStream (a checkpoint of a few hundred bytes); the loss of step `loss_at` is NaN;
    step `weight_at` overflows a gradient (loss finite, weights NaN); step `kill_at` gets Ctrl-C `kills` times."""
    from torch import nn
    from capsule_book.train import Task
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    calls = []

    def make(g): return [torch.randn(8, 3, generator=g) for _ in range(3)]

    def loss(net, x):
        calls.append(1)
        n = len(calls)
        err = (net(x) - x.sum(1, keepdim=True)).pow(2).mean()
        if n == kill_at:
            for _ in range(kills): os.kill(os.getpid(), signal.SIGINT)
        if n == loss_at: err = err * float("nan")
        if n == weight_at: err = err + (net.weight - net.weight.detach()).abs().sum().sqrt()   # 0, gradient NaN
        return err, {"err": err.detach()}

    return Task("toy", {}, model, torch.optim.SGD(model.parameters(), lr=0.1), SyntheticStream(make, 0), loss,
                lambda s: 0.1, resume_command="toy --resume")


def test_a_nan_loss_stops_the_run_and_the_finite_checkpoint_stays(tmp_path):
    from capsule_book.train import NonFiniteLoss, fit
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss) as e:
        fit(toy(loss_at=4), 10, out=out, checkpoint_every=2, log_every=1, progress=False)
    assert str(e.value) == (f"the loss became NaN or infinite at step 4 of 10 (loss=nan, err=nan); the run stopped: "
                            f"the last checkpoint, {out / 'last.pt'} at step 2 (finite), is kept")
    ck = load_checkpoint(out / "last.pt")
    assert ck["step"] == 2 and all(torch.isfinite(v).all() for v in ck["model"].values())
    same = fit(toy(), 2, progress=False).model                              # the checkpoint is step 2 of a sound run
    assert all(torch.equal(ck["model"][k], v) for k, v in same.state_dict().items())


def test_weights_that_turn_nan_under_a_finite_loss_are_never_saved(tmp_path):
    from capsule_book.train import NonFiniteLoss, fit
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match=r"weights became NaN or infinite by step 3 of 10 while the loss stayed "
                                            r"finite .*at step 2 \(finite\), is kept"):
        fit(toy(weight_at=3), 10, out=out, checkpoint_every=1, progress=False)
    assert load_checkpoint(out / "last.pt")["step"] == 2
    # the next step's model, fed its own NaN, fails: reported as the NaN, not as the model's complaint
    def refuses_nan(task):
        inner = task.loss
        def loss(net, x):
            if not torch.isfinite(net.weight).all(): raise ValueError("scales must be positive and finite")
            return inner(net, x)
        task.loss = loss
        return task
    with pytest.raises(NonFiniteLoss, match=r"^the weights became NaN or infinite by step 4 of 10 \(then ValueError: "
                                            r"scales must be positive and finite\); no checkpoint had been written"):
        fit(refuses_nan(toy(weight_at=3)), 10, out=tmp_path / "other", checkpoint_every=100, progress=False)
    assert not (tmp_path / "other").exists()                 # nothing to continue from: nothing left in the way


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing_in_the_way(tmp_path):
    from capsule_book.train import fit
    out = tmp_path / "run"
    task, calls = toy(), []
    inner = task.loss
    def failing(net, x):
        calls.append(1)
        if len(calls) == 3: raise ValueError("a bad batch")
        return inner(net, x)
    task.loss = failing
    with pytest.raises(ValueError, match=r"^at step 3 of 5: a bad batch; no checkpoint had been written"):
        fit(task, 5, out=out, log_every=1, progress=False)
    assert not out.exists()
    out.mkdir()
    (out / "metrics.jsonl").write_text("")                   # an empty metrics file blocks nothing either
    assert fit(toy(), 5, out=out, progress=False).finished


def test_ctrl_c_checkpoints_after_the_step_and_the_run_resumes_bit_exactly(tmp_path, capsys):
    from capsule_book.train import Interrupted, fit
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        fit(toy(kill_at=3), 8, out=out, log_every=1, checkpoint_every=100, progress=False)
    assert capsys.readouterr().out.strip() == (f"interrupted at step 3 of 8; {out / 'last.pt'} holds step 3: "
                                               "continue with `toy --resume`")
    assert load_checkpoint(out / "last.pt")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler          # the handler is put back
    resumed = fit(toy(), 8, out=out, resume=True, log_every=1, progress=False)
    straight = fit(toy(), 8, out=tmp_path / "straight", log_every=1, progress=False)
    assert resumed.finished and same_weights(resumed.model, straight.model)


def test_ctrl_c_twice_stops_at_once_and_a_fresh_run_leaves_no_folder(tmp_path, capsys):
    from capsule_book.train import Interrupted, fit
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        fit(toy(kill_at=2, kills=2), 8, out=out, log_every=1, progress=False)
    assert capsys.readouterr().out.strip() == "interrupted at step 1 of 8; nothing was saved"
    assert not out.exists()
    # resumed, the second Ctrl-C leaves the last checkpoint as it was
    fit(toy(), 8, out=out, stop_at=2, progress=False)
    capsys.readouterr()
    with pytest.raises(Interrupted):
        fit(toy(kill_at=2, kills=2), 8, out=out, resume=True, progress=False)
    assert capsys.readouterr().out.strip().startswith(f"interrupted at step 3 of 8; {out / 'last.pt'} holds step 2")
    assert load_checkpoint(out / "last.pt")["step"] == 2 and not list(out.glob(".*.tmp"))


def test_stale_temporary_checkpoints_are_removed_on_the_next_start(tmp_path):
    from capsule_book.train import fit
    out = tmp_path / "run"
    fit(toy(), 2, out=out, progress=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()                               # a process that has exited
    (out / f".last.pt.{dead}.tmp").write_bytes(b"half a checkpoint")
    (out / f".last.pt.{os.getppid()}.tmp").write_bytes(b"a living process's")     # still writing: kept
    fit(toy(), 4, out=out, resume=True, progress=False)
    assert sorted(x.name for x in out.iterdir()) == [f".last.pt.{os.getppid()}.tmp", "last.pt", "metrics.jsonl"]


def test_a_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"model": {}, "step": 1}, path)

    def full_disk(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        save_checkpoint({"model": {}, "step": 2}, path)
    monkeypatch.undo()
    assert [x.name for x in tmp_path.iterdir()] == ["last.pt"] and load_checkpoint(path)["step"] == 1
