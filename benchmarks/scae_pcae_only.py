"""Issue 29's diagnostic of a PCAE's parts: `--inspect CHECKPOINT` prints what tells a collapse from parts (the mean
centred cosine of the templates' ink and of their alpha logits, the spread of the part poses across parts on 64 test
digits, presences, the alpha logits' range) and, with --figures DIR, draws the templates, their alpha logits and the
parts of six digits; with --parts N, how much of the digits' class the part capsules carry: K-means (10 clusters,
Hungarian matching, as the SCAE's presences are scored) and a linear probe on N training and N test digits' part
presences, poses with presences, special features, and all three (each number standardised on the training digits),
and the mean number of parts present above 0.5 -- what an OCAE on these parts has to work with:

    python benchmarks/scae_pcae_only.py --inspect runs/scae-pcae-only-lr3e-4/last.pt --figures /tmp/figures
    python benchmarks/scae_pcae_only.py --inspect runs/scae-pcae-only-lr3e-4/last.pt --parts 5000

The two stages it was written for are options of the engine now (Chapter 11, *Two stages*):

    OMP_NUM_THREADS=1 capsule-book train scae --pcae-only --batch-size 32 --lr 3e-4 --out runs/scae-pcae-only-lr3e-4
    OMP_NUM_THREADS=1 capsule-book train scae --from-pcae runs/scae-pcae-only-lr3e-4/last.pt [--freeze-pcae] ...
"""
import argparse
import json
import sys

import torch

from capsule_book.scae import load_scae


def mean_centred_cosine(maps: torch.Tensor) -> float:
    "The mean cosine between two different maps [N, ...], each centred on its own mean."
    m = maps.flatten(1)
    m = m - m.mean(1, keepdim=True)
    m = m / m.norm(dim=1, keepdim=True).clamp_min(1e-12)
    n = m.shape[0]
    return float(((m @ m.T).sum() - n) / (n * n - n))


@torch.no_grad()
def part_capsules(model, batches) -> dict:
    """Part presences [n, N], poses [n, 6N] and special features [n, FN] (evaluation mode: no
    noise; the model's mode is restored), labels [n]."""
    was, got = model.training, {"presence": [], "pose": [], "features": [], "label": []}
    model.eval()
    for images, labels in batches:
        out = model(images, image_likelihood=False)
        got["presence"].append(out.part_presence); got["pose"].append(out.part_pose.flatten(1))
        got["features"].append(out.part_features.flatten(1)); got["label"].append(labels)
    model.train(was)
    return {k: torch.cat(v).double().numpy() if k != "label" else torch.cat(v).numpy()
            for k, v in got.items()}


PART_SETS = {"presence": ("presence",), "pose_presence": ("pose", "presence"),
             "features": ("features",), "all": ("pose", "presence", "features")}


def part_scores(train: dict, test: dict, n_init: int = 3) -> dict:
    """K-means test accuracy and linear-probe test accuracy of each set of `PART_SETS`, every
    number standardised by the training digits' mean and standard deviation."""
    import numpy as np
    from capsule_book.scae import kmeans_accuracy, linear_probe_accuracy
    res = {"parts_present": round(float((test["presence"] > 0.5).sum(1).mean()), 2)}
    for name, keys in PART_SETS.items():
        tr, te = (np.concatenate([d[k] for k in keys], 1) for d in (train, test))
        mu, sd = tr.mean(0), tr.std(0) + 1e-6
        tr, te = (tr - mu) / sd, (te - mu) / sd
        res[f"{name}_kmeans"] = round(kmeans_accuracy(tr, train["label"], te, test["label"],
                                                      n_init=n_init)["test"], 4)
        res[f"{name}_probe"] = round(linear_probe_accuracy(tr, train["label"], te, test["label"]), 4)
    return res


@torch.no_grad()
def inspect(path: str, figures: str = "", parts: int = 0, sample: bool = False) -> dict:
    "Collapse statistics of a run's checkpoint (see the module's text)."
    from capsule_book.data import CanvasBatches, load_mnist
    model, ck = load_scae(path)
    alpha = model.decoder.alpha_logits
    x, y = load_mnist(False, sample=sample)
    images, _ = next(iter(CanvasBatches(x[:64], y[:64], 64, model.config.canvas, seed=1)))
    out = model(images)
    res = {"step": ck.get("step"),
           "template_cosine": round(mean_centred_cosine(model.decoder.templates()), 4),
           "alpha_cosine": round(mean_centred_cosine(alpha), 4),
           "pose_spread": [round(v, 4) for v in out.part_pose.std(1).mean(0).tolist()],
           "presence": round(float(out.part_presence.mean()), 4),
           "alpha_range": [round(float(alpha.min()), 3), round(float(alpha.max()), 3)],
           "image_nll": round(float(-out.image_log_likelihood.mean()), 2)}
    if parts:
        xt, yt = load_mnist(True, sample=sample)
        on_canvas = lambda a, b: CanvasBatches(a[:parts], b[:parts], 500, model.config.canvas,
                                               shuffle=False, seed=1)
        res.update(part_scores(part_capsules(model, on_canvas(xt, yt)),
                               part_capsules(model, on_canvas(x, y))))
    if figures:
        import matplotlib
        matplotlib.use("Agg")
        from pathlib import Path
        from capsule_book.pcae import plot_templates
        from capsule_book.scae import plot_scae_parts
        Path(figures).mkdir(parents=True, exist_ok=True)
        plot_templates(model.decoder.templates(), title=f"step {res['step']}").savefig(
            f"{figures}/templates_step{res['step']}.png", dpi=80)
        lo, hi = res["alpha_range"]
        plot_templates((alpha - lo) / max(hi - lo, 1e-12),
                       title=f"alpha logits, step {res['step']} (black {lo}, white {hi})").savefig(
            f"{figures}/alpha_step{res['step']}.png", dpi=80)
        plot_scae_parts(out, images).savefig(f"{figures}/parts_step{res['step']}.png", dpi=80)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inspect", metavar="CHECKPOINT", required=True)
    p.add_argument("--figures", default="")
    p.add_argument("--parts", type=int, default=0, metavar="N",
                   help="K-means and linear probes on the part capsules of N training and N test digits")
    p.add_argument("--sample", action="store_true", help="the MNIST sample shipped with the package")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(inspect(a.inspect, a.figures, a.parts, a.sample)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
