"""Amortised clustering of a mixture of 4 Gaussians (Set Transformer paper, Section 5.3), chapter 5b.

Trains the paper's rows (rFF+pooling, SAB+PMA, ISAB(16)+PMA) with the book's engine, the same as
`capsule-book train mog --model NAME --out runs/mog-NAME`, and prints the held-out log-likelihood per point beside the
oracle's and the paper's table. The default is the paper's recipe: Adam, lr 1e-3 (1e-4 from step 35,000), batches of
10 sets with n ~ U{100..500}, 50,000 steps; the held-out benchmark is 100 batches of 10 sets (seed 2019).

    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py --models sab-pma --max-minutes 120   # resumable slices
    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py --steps 3000 --runs /tmp/mog          # a short schedule
    OMP_NUM_THREADS=1 python benchmarks/mog_clustering.py --speed                               # step time

--speed times one training step (forward, backward, Adam) at the recipe's sizes — a batch of 10 sets of 450 points,
an encoder of two ISABs with 32 inducing points, width 128, 4 heads — for a direct transcription of the authors'
modules (juho-lee/set_transformer modules.py: separate nn.Linear per projection, heads split and joined with
torch.cat, LayerNorm off as in their run.py) against capsule_book's SetTransformer (fused path, with the attention
of the ISABs and PMA regrouped by Eqs. (5.1)-(5.2) of chapter 5, and line-by-line path), in interleaved rounds on
one thread, and prints the medians and ratios, with the floating-point operations of each step's matrix products
(torch's FlopCounterMode): the work each model does, whatever its speed; and the time of those matrix products
alone (each replayed at its shapes, in the same rounds): what no change to the rest of the step can remove.
"""
import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from capsule_book.mog import MOG_MODELS, MogConfig, mog_nll, sample_mog, train_mog
from capsule_book.set_transformer import SetTransformer

PAPER = {"oracle": -1.4726, "rff-pooling": -2.0006, "sab-pma": -1.5145, "isab-pma": -1.5009}


class AuthorsMAB(nn.Module):
    "The authors' MAB, transcribed: O = Q_ + softmax(Q_K_ᵀ/√dim_V)V_ over heads joined by torch.cat; O + relu(fc_o(O))."
    def __init__(self, dim_Q, dim_K, dim_V, num_heads, ln=False):
        super().__init__()
        self.dim_V, self.num_heads = dim_V, num_heads
        self.fc_q, self.fc_k, self.fc_v = nn.Linear(dim_Q, dim_V), nn.Linear(dim_K, dim_V), nn.Linear(dim_K, dim_V)
        self.ln0 = nn.LayerNorm(dim_V) if ln else None
        self.ln1 = nn.LayerNorm(dim_V) if ln else None
        self.fc_o = nn.Linear(dim_V, dim_V)

    def forward(self, Q, K):
        Q = self.fc_q(Q)
        K, V = self.fc_k(K), self.fc_v(K)
        split = self.dim_V // self.num_heads
        Q_, K_, V_ = (torch.cat(t.split(split, 2), 0) for t in (Q, K, V))
        A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V), 2)
        O = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        O = O if self.ln0 is None else self.ln0(O)
        O = O + F.relu(self.fc_o(O))
        return O if self.ln1 is None else self.ln1(O)


class AuthorsSAB(nn.Module):
    def __init__(self, dim_in, dim_out, num_heads, ln=False):
        super().__init__()
        self.mab = AuthorsMAB(dim_in, dim_in, dim_out, num_heads, ln)

    def forward(self, X):
        return self.mab(X, X)


class AuthorsISAB(nn.Module):
    def __init__(self, dim_in, dim_out, num_heads, num_inds, ln=False):
        super().__init__()
        self.I = nn.Parameter(torch.empty(1, num_inds, dim_out))
        nn.init.xavier_uniform_(self.I)
        self.mab0 = AuthorsMAB(dim_out, dim_in, dim_out, num_heads, ln)
        self.mab1 = AuthorsMAB(dim_in, dim_out, dim_out, num_heads, ln)

    def forward(self, X):
        return self.mab1(X, self.mab0(self.I.repeat(X.size(0), 1, 1), X))


class AuthorsPMA(nn.Module):
    def __init__(self, dim, num_heads, num_seeds, ln=False):
        super().__init__()
        self.S = nn.Parameter(torch.empty(1, num_seeds, dim))
        nn.init.xavier_uniform_(self.S)
        self.mab = AuthorsMAB(dim, dim, dim, num_heads, ln)

    def forward(self, X):
        return self.mab(self.S.repeat(X.size(0), 1, 1), X)


def authors_set_transformer(num_inds=32, dim_hidden=128, num_heads=4, ln=False) -> nn.Module:
    "The authors' SetTransformer of run.py: two ISABs, PMA with 4 seeds, two SABs, a linear layer to 1 + 2·2."
    return nn.Sequential(AuthorsISAB(2, dim_hidden, num_heads, num_inds, ln),
                         AuthorsISAB(dim_hidden, dim_hidden, num_heads, num_inds, ln),
                         AuthorsPMA(dim_hidden, num_heads, 4, ln), AuthorsSAB(dim_hidden, dim_hidden, num_heads, ln),
                         AuthorsSAB(dim_hidden, dim_hidden, num_heads, ln), nn.Linear(dim_hidden, 5))


def speed(rounds: int = 7, steps: int = 3, n: int = 450) -> dict:
    """Median seconds per training step of each model, and of its matrix products alone, measured in interleaved
    rounds on the same batch."""
    torch.set_num_threads(1)
    X = sample_mog(10, n, generator=torch.Generator().manual_seed(0))[0]
    torch.manual_seed(0)
    ours = SetTransformer(2, 5, 4, dim=128, n_heads=4, n_layers=2, n_inducing=32)
    plain = SetTransformer(2, 5, 4, dim=128, n_heads=4, n_layers=2, n_inducing=32)
    for m in plain.modules():
        if hasattr(m, "fused"): m.fused = False
    models = {"authors' modules": authors_set_transformer(), "capsule_book, fused": ours,
              "capsule_book, line by line": plain}
    opts = {k: torch.optim.Adam(m.parameters(), 1e-3) for k, m in models.items()}
    products = {k: step_products(m, X) for k, m in models.items()}      # the products alone
    times = {k: [] for k in models}
    product_times = {k: [] for k in models}
    for r in range(rounds + 1):
        for k, m in models.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = mog_nll(m(X), X)
                opts[k].zero_grad(); loss.backward(); opts[k].step()
            t1 = time.perf_counter()
            for _ in range(steps): products[k]()
            if r:                                                   # round 0 warms up
                times[k].append((t1 - t0) / steps); product_times[k].append((time.perf_counter() - t1) / steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["authors' modules"]
    flops = {k: step_flops(m, X) for k, m in models.items()}
    return {k: {"ms": round(1000 * v, 1), "speed-up": round(ref / v, 2),        # over the authors'
                "gflop": round(flops[k] / 1e9, 2),
                "products ms": round(1000 * statistics.median(product_times[k]), 1)} for k, v in med.items()}


def step_products(model: nn.Module, X: torch.Tensor):
    """A function that runs the matrix products of one forward and backward of `model` on X alone: every
    mm/bmm/addmm/baddbmm (or in place) that reaches torch's dispatcher, at its shapes, on contiguous random operands."""
    from torch.utils._python_dispatch import TorchDispatchMode
    aten = torch.ops.aten
    products = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.addmm_.default, aten.baddbmm.default,
                aten.baddbmm_.default}
    g = torch.Generator().manual_seed(0)
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products:
                calls.append((func, [torch.randn(a.shape, generator=g) for a in args if isinstance(a, torch.Tensor)],
                              kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        mog_nll(model(X), X).backward()
    model.zero_grad()
    def run():
        for f, args, kw in calls: f(*args, **kw)
    return run


def step_flops(model: nn.Module, X: torch.Tensor) -> int:
    "Floating-point operations of the matrix products of one forward and backward, as torch counts them."
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        mog_nll(model(X), X).backward()
    model.zero_grad()
    return fc.get_total_flops()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MOG_MODELS), help="comma-separated: " + ", ".join(MOG_MODELS))
    p.add_argument("--steps", type=int, default=50_000, help="training steps (paper: 50,000)")
    p.add_argument("--runs", default="runs", help="folder of the run folders mog-NAME (resumed when present)")
    p.add_argument("--max-minutes", type=float, default=None, help="per model; resume with the same command")
    p.add_argument("--device", default=None)
    p.add_argument("--speed", action="store_true", help="time one training step against the authors' modules")
    p.add_argument("--rounds", type=int, default=7, help="--speed: interleaved rounds (median)")
    p.add_argument("--out", default=None, help="--speed: also write the JSON to this file")
    args = p.parse_args()
    if args.speed:
        res = speed(args.rounds)
        from capsule_book.utils import cpu_name
        print("| model (batch 10 × 450 points, ISAB(32) encoder, 1 thread) | ms per step | speed-up | GFLOP per step "
              "| its matrix products alone, ms |\n|---|---|---|---|---|")
        for k, v in res.items(): print(f"| {k} | {v['ms']} | {v['speed-up']}× | {v['gflop']} | {v['products ms']} |")
        record = {"cpu": cpu_name(), "threads": 1, "rounds": args.rounds, "models": res}
        print(json.dumps(record))
        if args.out: Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        return
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
