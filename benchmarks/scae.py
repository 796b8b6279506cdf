"""Benchmark of Chapters 10-12: the image Stacked Capsule Autoencoder's training step, against a direct transcription.

    python benchmarks/scae.py --speed                       # batch 128 (official), against commit f0b714c
    python benchmarks/scae.py --speed --batch-size 32 --rounds 5
    python benchmarks/scae.py --frozen                      # a frozen-PCAE step, image term or not

The reference is the book's first version of the model (commit f0b714c, a temporary `git worktree`): a direct
transcription of the official TensorFlow model (`F.affine_grid` for the placement, Eq. (10.5) through autograd as
written, every output of the forward pass built in training too). --speed times one training step (forward, loss,
backward, RMSProp on the flat parameters) of the official configuration in both trees, in rotating rounds of fresh
processes with the same thread count, and prints the median milliseconds per step of each and their ratio; it also
checks that both compute the same loss (evaluation mode, no noise) on the same batch from the same initial weights.
The time of a step is the process's CPU time (one thread, the kernel's time on its behalf included): on a machine
whose other core is busy, wall-clock time measures the neighbours as much as the step; the wall-clock medians are
reported beside it. By default each tree runs as it trains: the book's with its freed memory kept
(`keep_freed_memory`, as `capsule-book train`), the reference with glibc's defaults; `--same-allocator` gives both
the same allocator settings, to time the steps' arithmetic alone. --frozen times, in the book's tree
alone, the step of the second stage (`scae_task(freeze_pcae=True)`: only the OCAE learns) computing the image
likelihood, as it did before the frozen step left it out, against the step as it trains now, without it (the same
gradients: tests/test_scae.py), and that step with the readout's keys and values in two maps (`composed=False`)
against one (Eq. 11.1a). Writes the result to --out (JSON).

Training itself runs through the engine: `capsule-book train scae ...` (Chapter 11).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from capsule_book.utils import cpu_name

# one timing round, run in a fresh process with PYTHONPATH set to the tree under test
SPEED_WORKER = r"""
import json, sys, time
try:                                   # as `capsule-book train` runs: freed memory kept (Appendix D)
    from capsule_book.cli import keep_freed_memory
    keep_freed_memory()
except ImportError:                    # a tree without it: glibc's defaults
    pass
import torch
from capsule_book import scae
from capsule_book.data import CanvasBatches, load_mnist
steps, warmup, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "whole"     # whole, frozen_image, frozen or frozen_two_maps
torch.set_flush_denormal(True)
torch.manual_seed(0)
model = scae.SCAE(seed=0)
x, y = load_mnist(True, sample=True)
images = next(iter(CanvasBatches(x, y, batch_size=batch, shuffle=True, seed=0)))[0]
model.eval()
with torch.no_grad():
    loss0 = model(images).loss.item()          # the function check (no noise)
model.train()
torch.manual_seed(1)
with torch.no_grad():                          # in training (the fused kernel where it runs)
    loss_train = model(images).loss.item()
frozen = {} if mode == "whole" else {"freeze_pcae": True}
opt = scae.scae_task(model, batch_size=batch, sample=True, eval_n=10, **frozen).optimizer
kwargs = {} if mode == "whole" else {"image_likelihood": mode == "frozen_image"}
if mode == "frozen_two_maps": model.encoder.composed = False     # Eq. (11.1a) as written
def step():
    loss = model(images, **kwargs).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
for _ in range(warmup): step()
cpu, wall = [], []
for _ in range(steps):
    c0, t0 = time.process_time(), time.perf_counter()
    step()
    cpu.append(time.process_time() - c0); wall.append(time.perf_counter() - t0)
cpu.sort(); wall.sort()
print(json.dumps({"ms": 1000 * cpu[len(cpu) // 2], "wall_ms": 1000 * wall[len(wall) // 2], "loss": loss0,
                  "loss_train": loss_train}))
"""


TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"

def round_of(tree: Path, steps: int, warmup: int, batch: int, threads: int,
             same_allocator: bool = False, mode: str = "whole", fused: bool = True) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads),
           "CAPSULE_BOOK_FUSED": "1" if fused else "0"}
    if same_allocator: env["GLIBC_TUNABLES"] = TUNABLES
    # run in the tree itself: `python -c` puts the working directory first on sys.path, ahead of
    # PYTHONPATH, so from a checkout's root every tree would import that checkout's package
    out = subprocess.run([sys.executable, "-c", SPEED_WORKER, str(steps), str(warmup), str(batch), mode],
                         env=env, cwd=str(tree), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rotating_rounds(runners: dict, rounds: int) -> dict:
    """Each runner (name -> a function giving one round's result) once a round, the order reversed
    every other round: name -> its rounds' results."""
    runs = {name: [] for name in runners}
    for r in range(rounds):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            runs[name].append(runners[name]())
        print(f"round {r + 1}: " + ", ".join(f"{n} {runs[n][-1]['ms']:.0f} ms" for n in runners),
              file=sys.stderr)
    return runs


def ratio_per_round(slow: list, fast: list) -> list:
    return [round(a["ms"] / b["ms"], 3) for a, b in zip(slow, fast)]


def speed(reference: str, rounds: int, steps: int, warmup: int, batch: int, threads: int,
          same_allocator: bool = False) -> dict:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        ref_tree = Path(tmp) / "reference"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(ref_tree), reference],
                       check=True, capture_output=True)
        try:
            # the book's tree twice: as it trains (the fused kernel of Appendix H) and on
            # Chapter 10's PyTorch path (CAPSULE_BOOK_FUSED=0)
            trees = {"reference": (ref_tree, True), "book": (root, True),
                     "book_pytorch_path": (root, False)}
            runs = rotating_rounds({name: (lambda t=tree, f=fused: round_of(
                t, steps, warmup, batch, threads, same_allocator, fused=f))
                                    for name, (tree, fused) in trees.items()}, rounds)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(ref_tree)],
                           check=False, capture_output=True)
    ms = {n: statistics.median(x["ms"] for x in v) for n, v in runs.items()}
    losses = {n: v[0]["loss"] for n, v in runs.items()}
    return {"reference": reference, "batch_size": batch, "threads": threads, "rounds": rounds,
            "allocator": "glibc tunables for both" if same_allocator else "as run: the book's tree "
                         "keeps freed memory (capsule-book train), the reference glibc's defaults",
            "steps_per_round": steps, "cpu": cpu_name(),
            "ms_per_step": {n: round(v, 1) for n, v in ms.items()},
            "wall_ms_per_step": {n: round(statistics.median(x["wall_ms"] for x in v), 1)
                                 for n, v in runs.items()},
            "speedup": round(ms["reference"] / ms["book"], 3),
            "speedup_per_round": ratio_per_round(runs["reference"], runs["book"]),
            "speedup_pytorch_path": round(ms["reference"] / ms["book_pytorch_path"], 3),
            "speedup_pytorch_path_per_round": ratio_per_round(runs["reference"],
                                                              runs["book_pytorch_path"]),
            "loss": losses, "same_loss": abs(losses["reference"] - losses["book"])
            <= 1e-4 * abs(losses["reference"]),
            # a training-mode forward (the same noise): fused against Chapter 10's path
            "loss_train": {n: runs[n][0]["loss_train"] for n in ("book", "book_pytorch_path")},
            "same_loss_train": abs(runs["book"][0]["loss_train"]
                                   - runs["book_pytorch_path"][0]["loss_train"])
            <= 1e-5 * abs(runs["book"][0]["loss_train"])}


def frozen(rounds: int, steps: int, warmup: int, batch: int, threads: int) -> dict:
    """The frozen-PCAE step with the image likelihood computed against without it, and without it
    with the readout's keys and values in two maps against one, in this tree."""
    root = Path(__file__).resolve().parent.parent
    modes = {"with_image_term": "frozen_image", "without": "frozen", "two_maps": "frozen_two_maps"}
    runs = rotating_rounds({name: (lambda m=mode: round_of(root, steps, warmup, batch, threads,
                                                           mode=m))
                            for name, mode in modes.items()}, rounds)
    ms = {n: statistics.median(x["ms"] for x in v) for n, v in runs.items()}
    return {"what": "a training step of the second stage (PCAE frozen, only the OCAE learns)",
            "batch_size": batch, "threads": threads, "rounds": rounds, "steps_per_round": steps,
            "cpu": cpu_name(), "ms_per_step": {n: round(v, 1) for n, v in ms.items()},
            "wall_ms_per_step": {n: round(statistics.median(x["wall_ms"] for x in v), 1)
                                 for n, v in runs.items()},
            "speedup": round(ms["with_image_term"] / ms["without"], 3),
            "speedup_per_round": ratio_per_round(runs["with_image_term"], runs["without"]),
            "composed_speedup": round(ms["two_maps"] / ms["without"], 3),
            "composed_speedup_per_round": ratio_per_round(runs["two_maps"], runs["without"])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speed", action="store_true", help="time the training step against --reference")
    p.add_argument("--frozen", action="store_true",
                   help="time the frozen-PCAE step with and without the image likelihood")
    p.add_argument("--reference", default="f0b714c", help="the commit to time against (default f0b714c)")
    p.add_argument("--batch-size", type=int, default=128, help="official 128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round (median taken)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--same-allocator", action="store_true",
                   help="both trees with glibc's freed memory kept (GLIBC_TUNABLES), the steps alone")
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    if args.speed == args.frozen:
        p.error("pass one of --speed and --frozen (training runs through `capsule-book train scae`)")
    if args.frozen:
        report = frozen(args.rounds, args.steps, args.warmup, args.batch_size, args.threads)
    else:
        report = speed(args.reference, args.rounds, args.steps, args.warmup, args.batch_size,
                       args.threads, args.same_allocator)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
