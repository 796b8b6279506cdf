"""The capsule-book command line under bad input: every mistake one line naming the argument and exit status 2, a
NaN loss stopped with its last finite checkpoint kept, Ctrl-C checkpointed with exit status 130, no temporary file
or half-begun folder left in the way, a clone's weights used without a network."""
import errno
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from capsule_book import weights
from capsule_book.cli import main
from capsule_book.train import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
# a mixture model of a few thousand weights: a step takes milliseconds, a checkpoint 45 kB
TINY_MOG = ["--model", "rff-pooling", "--dim", "8", "--eval-batches", "1", "--n-min", "5", "--n-max", "10",
            "--no-progress", "--device", "cpu", "--log-every", "1"]
TINY_CAPSNET = ["--limit-train", "32", "--limit-test", "32", "--batch-size", "16", "--routing-iterations", "1",
                "--sample", "--device", "cpu", "--no-progress"]
TINY_CCAE = ["--dim", "16", "--n-layers", "1", "--n-heads", "2", "--batch-size", "4", "--no-progress", "--eval-n", "10",
             "--device", "cpu"]


def refused(argv, capsys) -> str:
    "The one line a refused command prints (exit status 2, no traceback)."
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("argv, words", [
    (["train", "capsnet", "--recon-weight", "nan"], "argument --recon-weight: must be a finite number >= 0, got nan"),
    (["train", "capsnet", "--recon-weight", "-1"], "argument --recon-weight: must be a finite number >= 0, got -1"),
    (["train", "capsnet", "--routing-bias", "nan"], "argument --routing-bias: must be a finite number, got nan"),
    (["train", "capsnet", "--routing-bias", "inf"], "argument --routing-bias: must be a finite number, got inf"),
    (["train", "ccae", "--posterior-sparsity", "-5"], "argument --posterior-sparsity: must be a finite number >= 0"),
    (["train", "ccae", "--prior-sparsity", "nan"], "argument --prior-sparsity: must be a finite number >= 0, got nan"),
    (["train", "ccae", "--background", "nan"], "argument --background: must be a finite number >= 0, got nan"),
    (["train", "ccae", "--drop-prob", "1"], "argument --drop-prob: must be a number in [0, 1), got 1"),
    (["train", "ccae", "--average", "nan"], "argument --average: must be a number in [0, 1), got nan"),
    (["train", "ccae", "--lr-decay", "2"], "argument --lr-decay: must be a number in [0, 1], got 2"),
    (["train", "ccae", "--complete-steps", "-100"], "argument --complete-steps: must be an integer >= 0"),
    (["train", "mog", "--eval-every", "-1"], "argument --eval-every: must be an integer >= 0, got -1"),
    (["train", "mog", "--lr", "1e999"], "argument --lr: must be a positive number, got 1e999"),
])
def test_bad_numbers_are_refused_by_name_before_anything_runs(argv, words, capsys, tmp_path):
    out = tmp_path / "run"
    small = {"capsnet": TINY_CAPSNET, "mog": TINY_MOG, "ccae": TINY_CCAE}[argv[1]]   # were it accepted: one step
    assert words in refused(argv + small + ["--steps", "1", "--out", str(out)], capsys)
    assert not out.exists()                                # refused at once: no folder, no metrics.jsonl


def test_prior_sparsity_nan_leaves_nothing_and_the_fixed_command_runs(capsys, tmp_path):
    out = str(tmp_path / "ccae")
    small = ["train", "ccae", *TINY_CCAE, "--steps", "1", "--out", out]
    assert "--prior-sparsity" in refused(small + ["--prior-sparsity", "nan"], capsys)
    assert main(small + ["--prior-sparsity", "0"]) == 0                  # the same --out, not blocked
    assert load_checkpoint(Path(out) / "last.pt")["step"] == 1


def test_out_that_is_a_file_or_under_a_file_is_refused(capsys, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("not a folder")
    line = refused(["train", "mog", *TINY_MOG, "--steps", "2", "--out", str(f)], capsys)
    assert line == f"capsule-book: error: --out {f} is a file, not a folder: choose another --out"
    line = refused(["train", "mog", *TINY_MOG, "--steps", "2", "--out", str(f / "run")], capsys)
    assert line == (f"capsule-book: error: --out {f / 'run'} lies under {f}, which is a file, not a folder: "
                    "choose another --out")
    assert f.read_text() == "not a folder"


@pytest.mark.parametrize("exists", [False, True])
def test_out_on_a_read_only_disk_is_refused(capsys, tmp_path, monkeypatch, exists):
    # root ignores chmod, so the read-only file system is the error it raises (EROFS)
    out = tmp_path / "ro"
    if exists: out.mkdir()

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir" if not exists else "write_bytes", read_only)
    line = refused(["train", "mog", *TINY_MOG, "--steps", "2", "--out", str(out)], capsys)
    assert line == f"capsule-book: error: cannot write the run folder --out {out}: Read-only file system"


def test_eval_mog_refuses_n_min_above_n_max(capsys):
    line = refused(["eval", "mog", "--weights", "mog-rff-pooling", "--n-min", "500", "--n-max", "100"], capsys)
    assert line == "capsule-book: error: need --n-min <= --n-max, got 500 and 100"
    line = refused(["eval", "mog", "--weights", "mog-rff-pooling", "--n-min", "600"], capsys)
    assert line.endswith("need --n-min <= --n-max, got 600 and 500 (the run's own where not given)")


def test_a_nan_loss_stops_the_run_in_one_line_and_keeps_the_last_finite_checkpoint(capsys, tmp_path):
    out = tmp_path / "run"
    # η = 1e30: one step makes the weights huge, the next step's capsules NaN
    argv = ["train", "capsnet", *TINY_CAPSNET, "--steps", "6", "--checkpoint-every", "1", "--log-every", "1", "--lr",
            "1e30", "--out", str(out)]
    line = refused(argv, capsys)
    assert line.startswith("capsule-book: error: the loss became NaN or infinite at step 2 of 6 (loss=nan")
    assert line.endswith(f"the last checkpoint, {out / 'last.pt'} at step 1 (finite), is kept")
    ck = load_checkpoint(out / "last.pt")
    assert ck["step"] == 1 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"])
    (out / "last.pt").unlink()                                                     # 98 MB: not kept by the test


def interrupt_when(p: subprocess.Popen, ready, timeout: float = 120, sig=signal.SIGINT) -> None:
    "Send `sig` (SIGINT: Ctrl-C) to `p` once ready() is true (a file the run writes appeared)."
    deadline = time.monotonic() + timeout
    while not ready():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    p.send_signal(sig)


def test_ctrl_c_checkpoints_exits_130_and_prints_the_resume_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "mog", *TINY_MOG, "--steps", "1000000", "--checkpoint-every", "1000000", "--out", str(out)]
    p = subprocess.Popen([sys.executable, "-c", "import sys; from capsule_book.cli import main; sys.exit(main())",
                          *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    interrupt_when(p, lambda: (out / "metrics.jsonl").exists())        # a few steps in, long before a checkpoint
    said, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err
    step = load_checkpoint(out / "last.pt")["step"]
    resume = f"capsule-book {shlex.join(argv)} --resume"
    assert said.strip().splitlines() == [f"interrupted at step {step} of 1000000; {out / 'last.pt'} holds step "
                                         f"{step}: continue with `{resume}`"]
    assert step >= 1 and sorted(x.name for x in out.iterdir()) == ["last.pt", "metrics.jsonl"]
    # the printed command continues the run (to two more steps)
    assert main(shlex.split(resume)[1:] + ["--steps", str(step + 2)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == step + 2


def test_kill_checkpoints_a_background_run_that_ignores_ctrl_c(tmp_path):
    "`nohup … &` starts a run with SIGINT ignored; the SIGTERM of `kill` still stops it with a checkpoint."
    out = tmp_path / "run"
    argv = ["train", "mog", *TINY_MOG, "--steps", "1000000", "--checkpoint-every", "1000000", "--out", str(out)]
    p = subprocess.Popen([sys.executable, "-c", "import sys; from capsule_book.cli import main; sys.exit(main())",
                          *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    interrupt_when(p, lambda: (out / "metrics.jsonl").exists())        # ignored, as the shell asked
    time.sleep(0.5)
    assert p.poll() is None and not (out / "last.pt").exists()
    p.send_signal(signal.SIGTERM)
    said, err = p.communicate(timeout=120)
    assert p.returncode == 143 and "Traceback" not in err, err           # 128 + SIGTERM
    assert "SIGTERM: stopping after this step, with a checkpoint" in err
    step = load_checkpoint(out / "last.pt")["step"]
    assert step >= 1 and said.strip().splitlines()[-1].startswith(
        f"interrupted at step {step} of 1000000; {out / 'last.pt'} holds step {step}: continue with")


def test_ctrl_c_twice_before_the_first_checkpoint_leaves_nothing_in_the_way(tmp_path, capsys, monkeypatch):
    import capsule_book.mog as mog
    out = tmp_path / "run"
    argv = ["train", "mog", *TINY_MOG, "--steps", "5", "--out", str(out)]
    real = mog.mog_nll

    def impatient(raw, X, mask=None):                   # Ctrl-C twice inside the first step
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real(raw, X, mask)

    monkeypatch.setattr(mog, "mog_nll", impatient)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 130
    assert capsys.readouterr().out.strip().splitlines()[-1] == "interrupted at step 0 of 5; nothing was saved"
    assert not out.exists()
    monkeypatch.undo()
    assert main(argv) == 0                                               # the same command runs
    assert load_checkpoint(out / "last.pt")["step"] == 5


DYING_SAVE = """
import os, signal, sys, torch
from capsule_book.cli import main
real = torch.save
def killed_while_saving(obj, f, *args, **kwargs):
    real(obj, f, *args, **kwargs)                # the temporary file written, not yet renamed
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = killed_while_saving
main(sys.argv[1:])
"""


def test_a_kill_while_saving_leaves_a_temporary_file_the_next_start_removes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "mog", *TINY_MOG, "--steps", "2", "--out", str(out)]
    assert main(argv) == 0
    r = subprocess.run([sys.executable, "-c", DYING_SAVE, *argv, "--resume", "--steps", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    stale = [x.name for x in out.iterdir() if x.name.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].startswith(".last.pt.")        # killed after the write, before the rename
    assert load_checkpoint(out / "last.pt")["step"] == 2                  # the checkpoint before it is whole
    assert main(argv + ["--resume", "--steps", "4"]) == 0
    assert sorted(x.name for x in out.iterdir()) == ["last.pt", "metrics.jsonl"]
    assert load_checkpoint(out / "last.pt")["step"] == 4


@pytest.fixture
def offline(monkeypatch, tmp_path):
    "An installed wheel with no network: no clone beside the package, every download fails."
    def no_network(url, timeout=None):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(weights, "checkout_weights", lambda: None)
    monkeypatch.setattr(weights.urllib.request, "urlopen", no_network)
    monkeypatch.delenv("CAPSULE_BOOK_WEIGHTS", raising=False)
    monkeypatch.setenv("CAPSULE_BOOK_DATA", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


EVAL_MOG = ["eval", "mog", "--eval-batches", "1", "--device", "cpu"]


def test_a_clones_weights_serve_the_command_line_offline(offline, monkeypatch, capsys):
    line = refused(EVAL_MOG + ["--weights", "mog-rff-pooling"], capsys)
    assert "could not download" in line and "--weights-dir" in line and "CAPSULE_BOOK_WEIGHTS" in line
    folder = str(ROOT / "weights")
    assert main(EVAL_MOG + ["--weights", "mog-rff-pooling", "--weights-dir", folder]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("CAPSULE_BOOK_WEIGHTS", folder)
    assert main(EVAL_MOG + ["--weights", "mog-rff-pooling"]) == 0
    by_env = json.loads(capsys.readouterr().out)
    assert by_flag == by_env and by_flag["model"] == "rff-pooling" and math.isfinite(by_flag["ll"])


def test_the_download_error_points_at_a_weights_folder_in_the_current_one(offline, tmp_path, capsys):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "manifest.json").write_text((ROOT / "weights" / "manifest.json").read_text())
    line = refused(EVAL_MOG + ["--weights", "mog-rff-pooling"], capsys)
    assert line.endswith(f"(this folder has one: --weights-dir {tmp_path / 'weights'})")


def test_a_shipped_weights_file_as_checkpoint_says_what_to_pass(offline, capsys):
    line = refused(["eval", "ccae", "--checkpoint", str(ROOT / "weights" / "ccae.pt"), "--n", "10"], capsys)
    assert line == (f"capsule-book: error: --checkpoint {ROOT / 'weights' / 'ccae.pt'} holds the weights of shipped "
                    f"model 'ccae', not a run's checkpoint: use --weights ccae --weights-dir {ROOT / 'weights'}")
    line = refused(EVAL_MOG + ["--weights", "mog-rff-pooling", "--weights-dir", str(ROOT)], capsys)
    assert f"{ROOT} holds no manifest.json" in line


def test_ctrl_c_before_training_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    import capsule_book.mog as mog

    def interrupted(*args, **kwargs):                  # Ctrl-C while the task is built (data, model)
        raise KeyboardInterrupt

    monkeypatch.setattr(mog, "mog_task", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["train", "mog", *TINY_MOG, "--out", str(tmp_path / "run")])
    assert e.value.code == 130 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.strip() == "capsule-book: interrupted (nothing was written)"
