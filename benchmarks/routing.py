"""Speed of the routing layer of the MNIST CapsNet: capsule_book's Router against the seed's einsum Router.

Settings (issue 2): 1152 -> 10 capsules, 8 -> 16 dims, 3 iterations, batch 128, float32, CPU, forward+backward.
The baseline is labml's Router (its einsums 'ijnm,bin->bijm', 'bij,bijm->bjm', 'bjm,bijm->bij') with the softmax
moved to the output capsules, so both compute the same v. Both run on the same inputs and weights, interleaved,
and the script prints the median of several timed runs of each and their ratio. Other formulations that were tried
on the way are timed as well (`--all`). Run by hand, not in CI:

    python benchmarks/routing.py [--threads 2] [--repeats 7] [--all]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from capsule_book.routing import Router, coupling, route
from capsule_book.squash import squash


class SeedRouter(nn.Module):
    "labml's einsum Router, faithful except for the softmax axis (dim=-1, the output capsules, as its equation says)."
    def __init__(self, in_caps, out_caps, in_d, out_d, iterations):
        super().__init__()
        self.in_caps, self.out_caps, self.iterations = in_caps, out_caps, iterations
        self.weight = nn.Parameter(torch.randn(in_caps, out_caps, in_d, out_d))
        self.softmax = nn.Softmax(dim=-1)   # the seed has dim=1 (the input capsules)

    def forward(self, u):
        u_hat = torch.einsum("ijnm,bin->bijm", self.weight, u)
        b = u.new_zeros(u.shape[0], self.in_caps, self.out_caps)
        v = None
        for _ in range(self.iterations):
            c = self.softmax(b)
            s = torch.einsum("bij,bijm->bjm", c, u_hat)
            v = squash(s)
            a = torch.einsum("bjm,bijm->bij", v, u_hat)
            b = b + a
        return v


# Formulations tried on the way (each computes the same v with the same gradient as Router with detach_intermediate)
def via_einsum_detached(weight, u, iterations):
    "The seed's einsums, with û detached in the non-final iterations."
    u_hat = torch.einsum("ijnm,bin->bijm", weight, u)
    return route(u_hat, iterations, detach_intermediate=True)[0]


def via_bmm_over_in_caps(weight, u, iterations):
    "û by one bmm over in_caps ([I, B, n] @ [I, n, J·m]), copied to [B, J, I, m] so that Eq. (2) and a are matmuls."
    I, J, n, m = weight.shape
    B = u.shape[0]
    W_i = weight.permute(0, 2, 1, 3).reshape(I, n, J * m)
    u_hat = torch.bmm(u.transpose(0, 1), W_i).view(I, B, J, m).permute(1, 2, 0, 3).contiguous()  # [B, J, I, m]
    u_fixed = u_hat.detach()
    b = u.new_zeros(B, I, J)
    for r in range(iterations):
        last = r == iterations - 1
        c = coupling(b)
        s = torch.matmul(c.transpose(1, 2).unsqueeze(2), u_hat if last else u_fixed).squeeze(2)  # [B, J, m]
        v = squash(s)
        if not last:
            b = b + torch.matmul(u_fixed, v.unsqueeze(-1)).squeeze(-1).transpose(1, 2)
    return v


def via_broadcast_matmul(weight, u, iterations):
    "û by torch.matmul of u [B, I, 1, n] with W [I, n, J·m] (broadcast over the batch)."
    I, J, n, m = weight.shape
    B = u.shape[0]
    W_i = weight.permute(0, 2, 1, 3).reshape(I, n, J * m)
    u_hat = torch.matmul(u.unsqueeze(2), W_i).view(B, I, J, m)
    return route(u_hat, iterations, detach_intermediate=True)[0]


def timed(fn, repeats):
    "Median and min seconds of forward+backward over `repeats` runs (after one warm-up)."
    times = []
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        v = fn()
        (v * v).sum().backward()
        if k:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median over all runs is reported")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--all", action="store_true", help="also time the other formulations")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    I, J, n, m, R, B = 1152, 10, 8, 16, 3, args.batch

    ours = Router(I, J, n, m, R)
    seed = SeedRouter(I, J, n, m, R)
    with torch.no_grad():
        seed.weight.copy_(ours.weight)                     # same weights (same layout)
    u = squash(torch.randn(B, I, n)).requires_grad_(True)  # same inputs

    v_ours, v_seed = ours(u), seed(u)
    err = (v_ours - v_seed).abs().max().item()
    print(f"max |v_ours - v_seed| = {err:.2e} (float32)")
    assert err < 1e-5, "the two routers disagree"

    candidates = {"seed einsum Router (softmax over outputs)": lambda: seed(u),
                  "capsule_book Router": lambda: ours(u)}
    if args.all:
        W = ours.weight
        candidates.update({
            "einsum + detached û": lambda: via_einsum_detached(W, u, R),
            "bmm over in_caps, [B,J,I,m] layout": lambda: via_bmm_over_in_caps(W, u, R),
            "broadcast matmul u[B,I,1,n] @ W[I,n,J·m]": lambda: via_broadcast_matmul(W, u, R),
        })
    runs = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            med, _ = timed(fn, args.repeats)
            runs[name].append(med)
            u.grad = None
            for mod in (ours, seed):
                mod.zero_grad(set_to_none=True)
    print(f"routing 1152->10 capsules, 8->16 dims, {R} iterations, batch {B}, float32, CPU, "
          f"{args.threads} threads, forward+backward, median of {args.rounds}x{args.repeats} runs")
    base = statistics.median(runs["seed einsum Router (softmax over outputs)"])
    for name, ts in runs.items():
        t = statistics.median(ts)
        print(f"  {name:45s} {1000 * t:8.1f} ms   speed-up {base / t:5.2f}x")
    ratio = base / statistics.median(runs["capsule_book Router"])
    print(f"ratio seed / capsule_book = {ratio:.2f}")


if __name__ == "__main__":
    main()
