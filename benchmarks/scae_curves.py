"""The image SCAE's learning curves (issue 29): held-out K-means accuracy of every committed run, as one figure.

    python benchmarks/scae_curves.py                         # every results/scae_*.jsonl but the PCAE-alone runs
    python benchmarks/scae_curves.py A.jsonl B.jsonl --out curves.png

Each run's metrics file (the engine's `metrics.jsonl`, copied to benchmarks/results/) holds, at every evaluation, the
K-means test accuracy of the prior and the posterior object presences (clusters fitted and matched on training
digits, Chapter 11). The figure draws both against the digits the run has seen (epoch x 60,000, so that batches of
32 and 128 compare) and against its hours of one thread (`elapsed_s`; a run from a PCAE checkpoint counts its own
hours only), with the issue's goal (0.95) and the paper's 98.7%. It prints each run's last and best evaluation.
"""
import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def evaluations(path: Path) -> list[dict]:
    "The rows of a metrics file that hold an evaluation."
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval_prior_test" in r]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="metrics files (default: results/scae_*.jsonl)")
    p.add_argument("--out", type=Path, default=RESULTS / "scae_curves.png")
    args = p.parse_args(argv)
    # by default every run that trains the OCAE (a PCAE-alone run's presences come from an untrained one)
    files = args.files or [f for f in sorted(RESULTS.glob("scae_*.jsonl")) if "pcae_only" not in f.name]
    runs = {f.stem.removeprefix("scae_"): evaluations(f) for f in files}
    runs = {name: rows for name, rows in runs.items() if rows}
    if not runs:
        p.error("no metrics file with evaluations (eval_prior_test) among the files given")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey=True)
    for name, rows in runs.items():
        for i, kind in enumerate(("prior", "posterior")):
            acc = [r[f"eval_{kind}_test"] for r in rows]
            axes[i, 0].plot([r["epoch"] * 60_000 for r in rows], acc, "o-", ms=3, label=name)
            axes[i, 1].plot([r["elapsed_s"] / 3600 for r in rows], acc, "o-", ms=3, label=name)
        best = max(rows, key=lambda r: r["eval_prior_test"])
        print(f"{name}: last step {rows[-1]['step']:,} prior / posterior {rows[-1]['eval_prior_test']:.3f} / "
              f"{rows[-1]['eval_posterior_test']:.3f}; best prior {best['eval_prior_test']:.3f} at step "
              f"{best['step']:,}, {best['elapsed_s'] / 3600:.2f} h")
    for i, kind in enumerate(("prior", "posterior")):
        for j, xlabel in enumerate(("digits seen", "hours of one thread (wall clock)")):
            ax = axes[i, j]
            ax.axhline(0.95, color="k", lw=0.8, ls="--", label="goal 0.95")
            ax.axhline(0.987, color="k", lw=0.8, ls=":", label="paper 0.987")
            ax.set(xlabel=xlabel, ylim=(0, 1))
            if j == 0: ax.set(ylabel=f"K-means test accuracy ({kind})", xscale="log")
    axes[0, 0].legend(fontsize=7, loc="center left")
    fig.suptitle("Image SCAE on MNIST: K-means accuracy of the object presences, 5,000 or 10,000 test digits")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return runs


if __name__ == "__main__":
    main()
