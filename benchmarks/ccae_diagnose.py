"""Where a trained CCAE's segmentation goes wrong: reads `train ccae` / benchmarks/ccae.py checkpoints.

    python benchmarks/ccae_diagnose.py runs/ccae_benchmark/last.pt [more checkpoints ...] [--n 10000] [--json out.json]

For each checkpoint, on `n` fresh constellations (the seed of `evaluate_ccae`):
- the segmentation accuracy, also over the examples with 1, 2 and 3 objects present, and the one-capsule floor
  for each (every point in one capsule scores 1.0 on an example with one object);
- for examples with one object: how many capsules share its points;
- how many points a capsule wins in an example (when it wins any), and with how many of its votes;
- the learned static part poses OP_k,n (the templates, in each capsule's own frame): how many distinct part
  positions each capsule has (positions closer than 0.05 counted as one) and how many translations sit in the
  saturated range of tanh (|t| > 0.99);
- how far each point lies from its winning vote, beside that vote's scale.
Prints one JSON object per checkpoint.
"""
import argparse
import collections
import json
from pathlib import Path

import torch

from capsule_book.ccae import geometric_transform, load_ccae
from capsule_book.segmentation import segmentation_report
from capsule_book.constellations import make_constellations


def distinct_positions(points: torch.Tensor, tol: float = 0.05) -> int:
    "Number of clusters among points [N, 2] when those closer than `tol` are joined (single linkage)."
    n = len(points)
    parent = list(range(n))
    def root(i):
        while parent[i] != i: i = parent[i]
        return i
    close = torch.cdist(points, points) < tol
    for i in range(n):
        for j in range(i + 1, n):
            if close[i, j]: parent[root(j)] = root(i)
    return len({root(i) for i in range(n)})


@torch.no_grad()
def diagnose(path, n: int = 10_000) -> dict:
    model, ck = load_ccae(path)
    K, N, batch_size = model.K, model.N, ck.get("batch_size", 32)
    g = torch.Generator().manual_seed(12345)                                   # the constellations of evaluate_ccae
    lone, won, dist, lam, kept = collections.Counter(), collections.Counter(), [], [], []
    seen = 0
    while seen < n:
        d = make_constellations(100 * batch_size, generator=g)
        d = type(d)(*(t[: n - seen] for t in d))
        seen += len(d.points)
        out = model(d.points, d.presence)
        p = d.presence.bool()
        kept.append((out.assignment, d.pattern_id, d.presence, out.log_likelihood))
        vote = out.posterior.argmax(-1)                                         # winning vote k·N + n, [B, M]
        B = len(p)
        for b in range(B):
            if len(set(d.pattern_id[b][p[b]].tolist())) == 1:
                lone[len(set(out.assignment[b][p[b]].tolist()))] += 1
            for k in range(K):
                sel = p[b] & (out.assignment[b] == k)
                if sel.any():
                    won[(int(sel.sum()), len(set(vote[b][sel].tolist())))] += 1
        flat_votes, flat_scales = out.votes.reshape(B, K * N, 2), out.scales.reshape(B, K * N)
        winner = flat_votes.gather(1, vote[..., None].expand(-1, -1, 2))        # [B, M, 2]
        dist.append((d.points - winner).norm(dim=-1)[p]); lam.append(flat_scales.gather(1, vote)[p])
    a, y, pres, ll = (torch.cat(t) for t in zip(*kept))
    res = {"checkpoint": str(path), "step": ck["step"], **segmentation_report(a, y, pres, K),
           "log_likelihood": ll.mean().item(), "n": n}                          # = evaluate_ccae(model, n)
    dist, lam = torch.cat(dist), torch.cat(lam)
    templates = geometric_transform(model.op_static, model.similarity)[..., :2, 2]   # [K, N, 2], capsule frame
    n_lone = sum(lone.values())
    won_total = sum(won.values())
    res.update({
        "lone_object_capsules_used": {c: round(v / n_lone, 4) for c, v in sorted(lone.items())},
        "points_won_per_capsule_mean": round(sum(k[0] * v for k, v in won.items()) / won_total, 3),
        "points_won_per_capsule": {c: round(sum(v for k, v in won.items() if k[0] == c) / won_total, 4)
                                   for c in sorted({k[0] for k in won})},
        "points_per_vote_used_mean": round(sum(k[0] * v for k, v in won.items()) / sum(k[1] * v for k, v in won.items()), 3),
        "template_distinct_parts": [distinct_positions(templates[k]) for k in range(K)],
        "template_translations_saturated": round((templates.abs() > 0.99).float().mean().item(), 3),
        "winning_vote_distance_median": round(dist.median().item(), 4),
        "winning_vote_distance_q90": round(dist.quantile(0.9).item(), 4),
        "winning_vote_scale_median": round(lam.median().item(), 4),
    })
    return res


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    results = []
    for path in args.checkpoints:
        results.append(diagnose(path, args.n))
        print(json.dumps(results[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
