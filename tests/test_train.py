"""Training machinery of capsule_book.train and the capsule-book command: resumption, checkpoints, CLI, DDP."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capsule_book.cli import main
from capsule_book.data import MNISTBatches, load_mnist, random_shift
from capsule_book.train import TrainConfig, load_checkpoint, save_checkpoint, train_capsnet

TINY = dict(limit_train=32, limit_test=32, batch_size=16, routing_iterations=1, eval_batch_size=32, progress=False,
            device="cpu")


def test_resume_continues_exactly(tmp_path):
    straight = train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "a"), **TINY))
    train_capsnet(TrainConfig(epochs=1, out=str(tmp_path / "b"), **TINY))
    resumed = train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "b"), resume=True, **TINY))
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ck = load_checkpoint(tmp_path / "b" / "last.pt")
    assert ck["epoch"] == 2 and ck["scheduler"]["last_epoch"] == 4
    assert set(ck) >= {"model", "optimizer", "scheduler", "epoch", "rng", "config", "history"}
    lines = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [l["epoch"] for l in lines] == [1, 2] and lines[-1]["test_accuracy"] == straight.history[-1]["test_accuracy"]
    # stopped inside the second epoch (max_steps), then resumed: still the same weights
    train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "c"), max_steps=3, **TINY))
    stopped = load_checkpoint(tmp_path / "c" / "last.pt")
    assert (stopped["epoch"], stopped["batch"], stopped["scheduler"]["last_epoch"]) == (1, 1, 3)
    mid = train_capsnet(TrainConfig(epochs=2, out=str(tmp_path / "c"), resume=True, **TINY)).model.state_dict()
    assert all(torch.equal(a[k], mid[k]) for k in a)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)

    def crash(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1          # the old checkpoint survives a crash while saving


def test_shift_and_sharding():
    x, y = load_mnist(False, limit=20)
    g = torch.Generator().manual_seed(0)
    img = x[:4, None].float() / 255
    shifted = random_shift(img, 2, g)
    assert not torch.equal(shifted, img) and (shifted.sum((1, 2, 3)) <= img.sum((1, 2, 3)) + 1e-4).all()
    shards = [MNISTBatches(x, y, batch_size=3, shuffle=True, rank=r, world_size=3, pad=False) for r in range(3)]
    seen = sorted(i for s in shards for i in s.indices().tolist())
    assert seen == list(range(20))


def test_cli_bad_arguments_exit_2(capsys):
    for argv in (["train", "capsnet", "--epochs", "-1"], ["train", "no-such-model"], ["eval", "capsnet"],
                 ["train", "capsnet", "--routing-iterations", "three"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_cli_train_then_eval(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "capsnet", "--epochs", "1", "--limit-train", "32", "--limit-test", "32", "--batch-size", "16",
                 "--routing-iterations", "1", "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", "capsnet", "--checkpoint", str(out / "last.pt"), "--limit-test", "32"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["test_accuracy"] == trained["test_accuracy"] and evaluated["epochs"] == 1


WORKER = """
import os, sys, torch
from capsule_book.train import TrainConfig, train_capsnet
cfg = TrainConfig(epochs=1, out=sys.argv[1], limit_train=32, limit_test=32, batch_size=16, routing_iterations=1,
                  eval_batch_size=32, progress=False, device="cpu")
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
    ck = torch.load(tmp_path / "last.pt", weights_only=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["world_size"] == 2     # only rank 0 writes
    assert json.loads(lines[0])["test_n"] == 32                               # the test shards partition the set
    assert all(torch.equal(ck["model"][k], w0[k]) for k in w0)                # rank 0 saved the final weights
