"""Chapter 4's departures table: the book's CapsNet against each difference of Sabour's official code, one at a time.

Each row is one short run of `capsule-book train capsnet` (same seed, same data order, same schedule; --steps 235,
half an epoch, by default), differing from the book's defaults in one setting only:

    w-std-0.1       W_ij ~ N(0, 0.1²)            (official `weight_variable`, stddev 0.1; the book 0.01)
    routing-bias    s_j + β_j, β_j from 0.1      (official `bias_variable` in `_update_routing`; the paper has none)
    official-loss-scale  the margin loss ×1/20   (official `_margin_loss` halves both terms and `evaluate` takes
                    `reduce_mean` over batch and classes, where Eq. (4) sums over classes); the reconstruction term
                    is the paper's. Adam's updates do not change when the whole loss is scaled (up to ε), so the
                    run is the book's loss with the reconstruction weight ×20: --recon-weight 0.01
    full-gradient   gradient through every routing iteration (official: no stop_gradient; book: the last only)

    python benchmarks/capsnet_departures.py                 # train the missing runs in runs/dep-*, then collect
    python benchmarks/capsnet_departures.py --collect       # only collect the finished runs

Writes benchmarks/results/capsnet_departures.json: per row the flags, the test error on the 10,000 MNIST test digits
after the last step, the margin loss of the training batches over the last 50 steps (comparable across rows,
unlike the total loss), and the training minutes (one CPU thread each).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROWS = [
    ("book", [], "the book's defaults (σ 0.01, no bias, margin loss as in the paper, gradient through the last "
                 "iteration)"),
    ("w-std-0.1", ["--w-std", "0.1"], "W_ij initialised with σ = 0.1 (official) instead of 0.01"),
    ("routing-bias", ["--routing-bias", "0.1"], "a learned bias β_j added to s_j in every iteration, from 0.1 "
                                                "(official)"),
    ("official-loss-scale", ["--recon-weight", "0.01"], "margin loss ½ on both terms and averaged over the ten "
                                                        "classes (official): under Adam, reconstruction weight "
                                                        "×20 = 0.01"),
    ("full-gradient", ["--full-gradient"], "gradient through every routing iteration (official)"),
]


def last_eval(path: Path) -> dict:
    "The last evaluation row of a run's metrics.jsonl."
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_accuracy" in r]
    if not evals: raise SystemExit(f"{path} has no evaluation row: is the run finished?")
    return evals[-1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=235)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="runs", help="folder of the runs (runs/dep-<name>)")
    p.add_argument("--collect", action="store_true", help="do not train; collect the finished runs")
    p.add_argument("--out", default="benchmarks/results/capsnet_departures.json")
    args = p.parse_args(argv)
    rows = []
    for name, flags, what in ROWS:
        folder = Path(args.runs) / f"dep-{name}"
        command = ["capsule-book", "train", "capsnet", "--steps", str(args.steps), "--seed", str(args.seed),
                   *flags, "--out", str(folder), "--no-progress"]
        if not args.collect and not (folder / "metrics.jsonl").exists():
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ev = last_eval(folder / "metrics.jsonl")
        if ev["step"] != args.steps: raise SystemExit(f"{folder} stopped at step {ev['step']}, not {args.steps}")
        rows.append({"name": name, "what": what, "command": " ".join(command[:-1]), "steps": ev["step"],
                     "test_error": ev["eval_error"], "test_accuracy": ev["eval_accuracy"], "test_n": ev["eval_n"],
                     "train_margin_loss": ev["margin"], "train_minutes": round(ev["elapsed_s"] / 60, 1)})
        print(json.dumps(rows[-1]))
    report = {"steps": args.steps, "seed": args.seed, "threads": 1, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
