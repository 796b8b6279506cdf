"""benchmarks/gpu_session.sh, the prepared GPU session: its SMOKE path (a few steps on the CPU, the MNIST sample)
trains the image SCAE job, packs it, and the pack's float16 weights load through `weights.load` as a working model."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from capsule_book import weights
from capsule_book.train import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def run_job(tmp_path, job, **more_env):
    "gpu_session.sh's SMOKE path for `job`; asserts it was sent back and returns the unpacked pack."
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **more_env}
    (tmp_path / "out").mkdir(parents=True)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "train", job],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and f"sent: {job}" in done.stdout, done.stdout + done.stderr
    parts = sorted((tmp_path / "out").glob(f"{job}.tar*"))
    (tmp_path / "pack.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "pack.tar") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    return tmp_path / "unpacked" / job


def test_the_scae_job_trains_packs_and_loads(tmp_path):
    pack = run_job(tmp_path, "scae-mnist")
    entry = json.loads((pack / "weights" / "manifest.json").read_text())["models"]["scae-mnist"]
    assert entry["dtype"] == "float16" and entry["command"].startswith("capsule-book train scae --batch-size 128")
    assert "trained on the CPU by benchmarks/gpu_session.sh" in entry["notes"]
    assert [json.loads(r)["step"] for r in (pack / "metrics.jsonl").read_text().splitlines()][-1] == 3
    model = weights.load("scae-mnist", folder=pack / "weights", download=False)
    with torch.no_grad():
        out = model(torch.rand(2, 1, 40, 40))
    assert not model.training and out.object_presence.shape == (2, 32)
    assert ((out.object_presence >= 0) & (out.object_presence <= 1)).all()


def test_the_scae_job_goes_on_from_the_books_weights_with_scae_from(tmp_path):
    """SCAE_FROM: the job starts from a whole SCAE's weights (here a smoke run's, one parameter set to a value no
    training gives) at the official batch and rate; three steps at 3e-5 leave that value in the shipped weights."""
    first = run_job(tmp_path / "a", "scae-mnist")
    ck = load_checkpoint(tmp_path / "a" / "work" / "runs" / "scae-mnist" / "last.pt")
    key = next(k for k, v in ck["model"].items() if v.is_floating_point() and v.numel() > 100)
    for state in [ck["model"]] + ([ck["average"]] if isinstance(ck.get("average"), dict) else []):
        state[key] = torch.full_like(state[key], 0.123)
    torch.save(ck, tmp_path / "marked.pt")
    pack = run_job(tmp_path / "b", "scae-mnist", SCAE_FROM=str(tmp_path / "marked.pt"))
    entry = json.loads((pack / "weights" / "manifest.json").read_text())["models"]["scae-mnist"]
    assert f"--from-scae {tmp_path / 'marked.pt'} --batch-size 128 --prior-between 0.35 --lr 3e-5" in entry["command"]
    shipped = torch.load(pack / "weights" / "scae-mnist.pt", weights_only=True)[key].float()
    assert (shipped - 0.123).abs().max() < 0.01
    before = torch.load(first / "weights" / "scae-mnist.pt", weights_only=True)[key].float()
    assert (before - 0.123).abs().max() > 0.01                  # a run from scratch does not hold the mark


def test_a_chapter_4b_job_runs_eq41_then_the_cooldown_and_packs_both_curves(tmp_path):
    """A CapsNet of Chapter 4b trains in two runs, as its manifest command says: Eq. (4.1) in NAME-base, then the
    cooldown from that run's checkpoint; the pack carries the two runs' curve as one, and its entry both runs' steps
    and the shipped network's command, word for word."""
    pack = run_job(tmp_path, "capsnet-expanded-r1")
    entry = json.loads((pack / "weights" / "manifest.json").read_text())["models"]["capsnet-expanded-r1"]
    shipped = json.loads((ROOT / "weights" / "manifest.json").read_text())["models"]["capsnet-expanded-r1"]
    assert entry["command"] == shipped["command"]
    assert entry["config"]["cooldown_from_step"] == 3 and entry["config"]["routing_iterations"] == 1
    assert entry["steps"] == 6 and entry["metrics"] == "benchmarks/results/capsnet-expanded-r1.metrics.jsonl"
    rows = [json.loads(r) for r in (pack / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("cooldown", False)) for r in rows] == [
        (1, False), (2, False), (3, False), (4, True), (5, True), (6, True)]
    assert rows[3]["lr"] < rows[2]["lr"] and not (pack / "base-metrics.jsonl").exists()
    model = weights.load("capsnet-expanded-r1", folder=pack / "weights", download=False)
    with torch.no_grad():
        caps = model(torch.rand(2, 1, 40, 40)).caps
    assert caps.shape == (2, 10, 16) and (caps.norm(dim=-1) < 1).all()          # squashed: lengths below 1
