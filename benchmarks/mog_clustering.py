"""Amortised clustering of a mixture of 4 Gaussians (Set Transformer paper, Section 5.3), chapter 5b.

Trains the paper's rows (rFF+pooling, SAB+PMA, ISAB(16)+PMA) with the book's engine, the same as
`capsule-book train mog --model NAME --out runs/mog-NAME`, and prints the held-out log-likelihood per point beside the
oracle's and the paper's table. The default is the paper's recipe: Adam, lr 1e-3 (1e-4 from step 35,000), batches of
10 sets with n ~ U{100..500}, 50,000 steps; the held-out benchmark is 100 batches of 10 sets (seed 2019).

    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py --models sab-pma --max-minutes 120   # resumable slices
    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py --steps 3000 --runs /tmp/mog          # a short schedule
"""
import argparse
import json
from pathlib import Path

import torch

from capsule_book.mog import MOG_MODELS, MogConfig, train_mog

PAPER = {"oracle": -1.4726, "rff-pooling": -2.0006, "sab-pma": -1.5145, "isab-pma": -1.5009}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MOG_MODELS), help="comma-separated: " + ", ".join(MOG_MODELS))
    p.add_argument("--steps", type=int, default=50_000, help="training steps (paper: 50,000)")
    p.add_argument("--runs", default="runs", help="folder of the run folders mog-NAME (resumed when present)")
    p.add_argument("--max-minutes", type=float, default=None, help="per model; resume with the same command")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    print(f"torch threads {torch.get_num_threads()}, args {vars(args)}", flush=True)
    rows = {}
    for name in args.models.split(","):
        out = Path(args.runs) / f"mog-{name}"
        run = train_mog(MogConfig(model=name, steps=args.steps, out=str(out), resume=(out / "last.pt").exists(),
                                  max_minutes=args.max_minutes, device=args.device, progress=False))
        last = next((r for r in reversed(run.history) if "eval_ll" in r), None)
        if last: rows[name] = (last["eval_ll"], last["eval_oracle"], run.step, run.history[-1]["elapsed_s"])
    print("\n| model | paper LL/point | this run | steps | minutes |\n|---|---|---|---|---|")
    for name, (ll, oracle, step, seconds) in rows.items():
        print(f"| {name} | {PAPER[name]} | {ll:.4f} (oracle {oracle:.4f}) | {step} | {seconds / 60:.1f} |")
    print(json.dumps({name: dict(ll=r[0], oracle=r[1], step=r[2]) for name, r in rows.items()}))


if __name__ == "__main__":
    main()
