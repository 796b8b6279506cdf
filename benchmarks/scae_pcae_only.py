"""Issue 29's diagnostic run: the PCAE of Chapter 10 trained alone, inside the SCAE of Chapter 11 with every OCAE
weight of Eq. (11.3) set to 0 (part likelihood, dynamic L2, the four sparsity terms), so that only the image
likelihood trains the part encoder and the templates. Driven in slices through the engine, like `capsule-book train`:

    OMP_NUM_THREADS=1 python benchmarks/scae_pcae_only.py --out runs/scae-pcae-only-lr3e-4 --max-minutes 100
    OMP_NUM_THREADS=1 python benchmarks/scae_pcae_only.py --out runs/scae-pcae-only-lr3e-4 --max-minutes 100 --resume

`--from-pcae CHECKPOINT` starts the whole SCAE (every weight official) from a PCAE-alone checkpoint: the second
stage of a schedule that trains the cheap PCAE first (the OCAE changes the PCAE only through the special features:
poses, presences and templates reach it with their gradients stopped);

    OMP_NUM_THREADS=1 python benchmarks/scae_pcae_only.py --from-pcae runs/scae-pcae-only-lr3e-4/last.pt \
        --out runs/scae-after-pcae --max-minutes 100      # then --resume, without --from-pcae

`--tf-init` starts RMSProp's mean square at 1, as TensorFlow 1's `RMSPropOptimizer` does (PyTorch's starts at 0);
`--inspect CHECKPOINT` prints what tells a collapse from parts (the mean centred cosine of the templates' ink and of
their alpha logits, the spread of the part poses across parts on 64 test digits, presences, the alpha logits' range)
and, with --figures DIR, draws the templates, their alpha logits and the parts of six digits.
"""
import argparse
import json
import sys
from dataclasses import replace

import torch

from capsule_book.scae import SCAE, SCAEConfig, load_scae, train_scae

PCAE_ONLY = dict(part_ll_weight=0, dynamic_l2=0, prior_within=0, prior_between=0, posterior_within=0,
                 posterior_between=0)


def tf_rmsprop_start() -> None:
    "Every FlatRMSprop made after this call starts its mean square at 1 (TensorFlow 1), its momentum at 0."
    from capsule_book import ccae
    init = ccae.FlatRMSprop.__init__

    def start_at_one(self, model, compiled=False, **kwargs):
        init(self, model, compiled, **kwargs)
        flat = self.flat.detach()
        self.state[self.flat] = {"step": torch.zeros(()), "square_avg": torch.ones_like(flat),
                                 "momentum_buffer": torch.zeros_like(flat)}
    ccae.FlatRMSprop.__init__ = start_at_one


def scae_from_pcae(path: str, seed: int = 0) -> SCAE:
    "The SCAE with the official weights of Eq. (11.3) and the part encoder and decoder (and the untrained OCAE) of a PCAE-alone checkpoint."
    pcae, _ = load_scae(path)
    if any(getattr(pcae.config, k) != v for k, v in PCAE_ONLY.items()):
        raise SystemExit(f"{path} is not a PCAE-alone run (its OCAE weights are not all 0)")
    official = SCAEConfig()
    model = SCAE(replace(pcae.config, **{k: getattr(official, k) for k in PCAE_ONLY}), seed=seed)
    model.load_state_dict(pcae.state_dict())
    return model.train()


def mean_centred_cosine(maps: torch.Tensor) -> float:
    "The mean cosine between two different maps [N, ...], each centred on its own mean."
    m = maps.flatten(1)
    m = m - m.mean(1, keepdim=True)
    m = m / m.norm(dim=1, keepdim=True).clamp_min(1e-12)
    n = m.shape[0]
    return float(((m @ m.T).sum() - n) / (n * n - n))


@torch.no_grad()
def inspect(path: str, figures: str = "") -> dict:
    "Collapse statistics of a run's checkpoint (see the module's text)."
    from capsule_book.data import CanvasBatches, load_mnist
    model, ck = load_scae(path)
    alpha = model.decoder.alpha_logits
    x, y = load_mnist(False)
    images, _ = next(iter(CanvasBatches(x[:64], y[:64], 64, model.config.canvas, seed=1)))
    out = model(images)
    res = {"step": ck.get("step"),
           "template_cosine": round(mean_centred_cosine(model.decoder.templates()), 4),
           "alpha_cosine": round(mean_centred_cosine(alpha), 4),
           "pose_spread": [round(v, 4) for v in out.part_pose.std(1).mean(0).tolist()],
           "presence": round(float(out.part_presence.mean()), 4),
           "alpha_range": [round(float(alpha.min()), 3), round(float(alpha.max()), 3)],
           "image_nll": round(float(-out.image_log_likelihood.mean()), 2)}
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
    p.add_argument("--out", default="runs/scae-pcae-only")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-n", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=0, help="steps between K-means evaluations (0: at the end)")
    p.add_argument("--tf-init", action="store_true")
    p.add_argument("--inspect", metavar="CHECKPOINT")
    p.add_argument("--from-pcae", metavar="CHECKPOINT")
    p.add_argument("--figures", default="")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.inspect:
        print(json.dumps(inspect(a.inspect, a.figures)))
        return 0
    # as `capsule-book train`: freed memory kept, subnormal floats flushed to zero
    from capsule_book.cli import keep_freed_memory
    keep_freed_memory()
    torch.set_flush_denormal(True)
    if a.tf_init: tf_rmsprop_start()
    if a.from_pcae and a.resume:
        raise SystemExit("--from-pcae starts a run; continue it with --resume alone")
    model = (scae_from_pcae(a.from_pcae, a.seed) if a.from_pcae
             else SCAE(SCAEConfig(**PCAE_ONLY), seed=a.seed))
    result = train_scae(model, a.steps, out=a.out, resume=a.resume, max_minutes=a.max_minutes,
                        batch_size=a.batch_size, lr=a.lr, seed=a.seed, eval_n=a.eval_n, eval_every=a.eval_every,
                        checkpoint_every=500, log_every=100, progress=False)
    print(json.dumps({"step": result.step, "finished": result.finished,
                      **(result.history[-1] if result.history else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
