"""Amortised clustering of a mixture of 4 Gaussians (Set Transformer paper, Section 5.3), chapter 5.

Trains SAB+PMA and ISAB(16)+PMA Set Transformers on fresh sets of n ~ U(100, 500) 2-D points and prints the
held-out log-likelihood per point beside the oracle's and the paper's table.

The default is the full recipe: Adam, lr 1e-3, batch of 10 sets, 50,000 steps, lr ÷ 10 halfway (the decay of the
authors' run.py), 100 held-out batches of 10 sets. Shorter schedules: --steps N (the decay stays at N/2).

    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py                  # full recipe
    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py --steps 3000     # a short schedule
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch

from capsule_book.set_transformer import SetTransformer, evaluate_mog, mog_benchmark, train_mog
from capsule_book.utils import pick_device, seed_everything

PAPER = {"oracle": -1.4726, "rFF+pooling": -2.0006, "SAB+PMA": -1.5145, "ISAB(16)+PMA": -1.5009}
MODELS = {"sab": ("SAB+PMA", None), "isab": ("ISAB(16)+PMA", 16)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50_000, help="training steps (paper: 50,000)")
    p.add_argument("--models", default="sab,isab", help="comma-separated: sab, isab")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--no-ln", action="store_true", help="turn LayerNorm off (the authors' default)")
    p.add_argument("--n-min", type=int, default=100)
    p.add_argument("--n-max", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=100, help="held-out batches of --batch sets")
    p.add_argument("--log-every", type=int, default=1000, help="evaluate on the held-out sets every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="JSON file for the results (written after every model)")
    p.add_argument("--ckpt-dir", default="checkpoints", help="where the trained weights go")
    args = p.parse_args()

    device = pick_device(args.device)
    print(f"device {device}, torch threads {torch.get_num_threads()}, args {vars(args)}", flush=True)
    sets, oracle = mog_benchmark(n_batches=args.eval_batches, batch=args.batch, n_min=args.n_min, n_max=args.n_max)
    print(f"held-out: {args.eval_batches} batches of {args.batch} sets, oracle LL/point {oracle:.4f} "
          f"(paper's oracle {PAPER['oracle']})", flush=True)
    results = dict(settings=vars(args), device=str(device), oracle=oracle, paper=PAPER, models={})
    for key in args.models.split(","):
        name, n_inducing = MODELS[key]
        seed_everything(args.seed)
        model = SetTransformer(dim_in=2, dim_out=5, n_outputs=4, dim=args.dim, n_heads=args.heads, n_layers=2,
                               n_inducing=n_inducing, ln=not args.no_ln).to(device)
        t0 = time.time()
        log = train_mog(model, args.steps, batch=args.batch, lr=args.lr, n_min=args.n_min, n_max=args.n_max,
                        seed=args.seed, device=device, progress=False, log_every=args.log_every, eval_sets=sets,
                        on_log=lambda e: print(f"  {name} step {e['step']:6d}  train nll {e['loss']:.4f}  "
                                               f"test LL {e.get('test_ll', float('nan')):.4f}  ({e['seconds']:.0f} s)",
                                               flush=True))
        seconds = time.time() - t0
        ll = evaluate_mog(model, sets, device)
        print(f"{name}: test LL/point {ll:.4f} (paper {PAPER[name]}, oracle here {oracle:.4f}) "
              f"after {args.steps} steps in {seconds / 60:.1f} min", flush=True)
        results["models"][name] = dict(test_ll=ll, minutes=seconds / 60, log=log)
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), Path(args.ckpt_dir) / f"mog_{key}_{args.steps}.pt")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| model | paper LL/point | this run | steps | minutes |\n|---|---|---|---|---|")
    print(f"| oracle | {PAPER['oracle']} | {oracle:.4f} | | |")
    for name, r in results["models"].items():
        print(f"| {name} | {PAPER[name]} | {r['test_ll']:.4f} | {args.steps} | {r['minutes']:.1f} |")


if __name__ == "__main__":
    main()
