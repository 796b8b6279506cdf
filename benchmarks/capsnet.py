"""Throughput of the whole MNIST CapsNet: capsule_book's `CapsNet` against labml's annotated CapsNet, side by side.

labml's model is written out below as labml has it (annotated_deep_learning_paper_implementations,
labml_nn/capsule_networks): primary capsules by `view(B, 8, 1152).permute(0, 2, 1)`, the einsum `Router` with
`torch.randn` weights and its softmax over dim=1 (the input capsules), the decoder masked by the *prediction* during
training, the un-squared margin loss and `nn.MSELoss` (a mean over pixels) for the reconstruction.

Default mode (minutes on 2 CPU cores): training throughput (forward + backward + Adam step, batch 128, float32) and
evaluation throughput (forward only, no grad, batch 128) of both models on the same real MNIST batches, timed in
interleaved rounds so that a busy machine slows both alike; prints the median images/s of each and the ratio. On a
CPU, where `CapsNet` computes the PrimaryCaps convolution in Fourier form (Appendix E), it also times `CapsNet` with
`conv_impl="direct"`, to show what the capsule side alone gains.

`--full` (not for CI; tens of minutes per model on a CPU): trains each model its own way from seed 0 and reports the
minutes to reach 99.0% test accuracy (tested every `--eval-every` steps on the 10 000 test digits). Ours: the paper's
settings (batch 128, shifts of 2 px, Adam 1e-3 decayed 0.96 per 2000 steps, label masking). labml's: its loss and
masking, Adam 1e-3, batch 128, no augmentation.

    OMP_NUM_THREADS=2 python benchmarks/capsnet.py [--rounds 5] [--steps 3] [--threads 2] [--device cpu]
    OMP_NUM_THREADS=2 python benchmarks/capsnet.py --full [--target 0.99] [--max-minutes 240]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from capsule_book.capsnet import CapsNet, capsnet_loss
from capsule_book.data import MNISTBatches, load_mnist, random_shift
from capsule_book.losses import MarginLoss
from capsule_book.capsnet import lr_factor
from capsule_book.utils import cpu_name, pick_device


# ---- labml's model, as labml writes it ------------------------------------------------------------------------
class LabmlSquash(nn.Module):
    def __init__(self, epsilon=1e-8):
        super().__init__()
        self.epsilon = epsilon

    def forward(self, s):
        s2 = (s ** 2).sum(dim=-1, keepdims=True)
        return (s2 / (1 + s2)) * (s / torch.sqrt(s2 + self.epsilon))


class LabmlRouter(nn.Module):
    def __init__(self, in_caps, out_caps, in_d, out_d, iterations):
        super().__init__()
        self.in_caps, self.out_caps, self.iterations = in_caps, out_caps, iterations
        self.softmax = nn.Softmax(dim=1)
        self.squash = LabmlSquash()
        self.weight = nn.Parameter(torch.randn(in_caps, out_caps, in_d, out_d), requires_grad=True)

    def forward(self, u):
        u_hat = torch.einsum('ijnm,bin->bijm', self.weight, u)
        b = u.new_zeros(u.shape[0], self.in_caps, self.out_caps)
        v = None
        for _ in range(self.iterations):
            c = self.softmax(b)
            s = torch.einsum('bij,bijm->bjm', c, u_hat)
            v = self.squash(s)
            a = torch.einsum('bjm,bijm->bij', v, u_hat)
            b = b + a
        return v


class LabmlMarginLoss(nn.Module):
    def __init__(self, *, n_labels, lambda_=0.5, m_positive=0.9, m_negative=0.1):
        super().__init__()
        self.m_negative, self.m_positive, self.lambda_, self.n_labels = m_negative, m_positive, lambda_, n_labels

    def forward(self, v, labels):
        v_norm = torch.sqrt((v ** 2).sum(dim=-1))
        labels = torch.eye(self.n_labels, device=labels.device)[labels]
        loss = labels * F.relu(self.m_positive - v_norm) + self.lambda_ * (1.0 - labels) * F.relu(v_norm - self.m_negative)
        return loss.sum(dim=-1).mean()


class LabmlCapsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels=1, out_channels=256, kernel_size=9, stride=1)
        self.conv2 = nn.Conv2d(in_channels=256, out_channels=32 * 8, kernel_size=9, stride=2, padding=0)
        self.squash = LabmlSquash()
        self.digit_capsules = LabmlRouter(32 * 6 * 6, 10, 8, 16, 3)
        self.decoder = nn.Sequential(nn.Linear(16 * 10, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                                     nn.Linear(1024, 784), nn.Sigmoid())

    def forward(self, data):
        x = F.relu(self.conv1(data))
        x = self.conv2(x)
        caps = x.view(x.shape[0], 8, 32 * 6 * 6).permute(0, 2, 1)
        caps = self.squash(caps)
        caps = self.digit_capsules(caps)
        with torch.no_grad():
            pred = (caps ** 2).sum(-1).argmax(-1)
            mask = torch.eye(10, device=data.device)[pred]
        reconstructions = self.decoder((caps * mask[:, :, None]).view(x.shape[0], -1)).view(-1, 1, 28, 28)
        return caps, reconstructions, pred


# ---- one training step of each, its own way ------------------------------------------------------------------------
def ours_step(model, opt, sched, margin, x, y):
    out = model(x, y)
    loss = capsnet_loss(out, x, y, margin)[0]
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    if sched is not None: sched.step()
    return loss


def labml_step(model, opt, margin, mse, x, y):
    caps, rec, pred = model(x)
    loss = margin(caps, y) + 0.0005 * mse(rec, x)
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return loss


@torch.no_grad()
def accuracy(predict, batches) -> float:
    correct = n = 0
    for x, y in batches:
        correct += (predict(x) == y).sum().item(); n += len(y)
    return correct / n


def throughput(args, device):
    images, labels = load_mnist(True, limit=args.batch_size * 8)
    batches = list(MNISTBatches(images, labels, args.batch_size, shuffle=True, max_shift=2, device=device))
    torch.manual_seed(0)
    ours, labml = CapsNet(3).to(device), LabmlCapsNet().to(device)
    direct = CapsNet(3, conv_impl="direct").to(device)                     # ours with PrimaryCaps by F.conv2d
    direct.load_state_dict(ours.state_dict())
    o_opt, s_opt = torch.optim.Adam(ours.parameters(), 1e-3), torch.optim.Adam(labml.parameters(), 1e-3)
    d_opt = torch.optim.Adam(direct.parameters(), 1e-3)
    margin, s_margin, mse = MarginLoss(10), LabmlMarginLoss(n_labels=10), nn.MSELoss()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    models = {"ours": ours, "ours, direct conv": direct, "labml": labml}
    train_fns = {"ours": lambda x, y: ours_step(ours, o_opt, None, margin, x, y),
                 "ours, direct conv": lambda x, y: ours_step(direct, d_opt, None, margin, x, y),
                 "labml": lambda x, y: labml_step(labml, s_opt, s_margin, mse, x, y)}
    eval_fns = {"ours": lambda x, y: ours.eval()(x).predictions,
                "ours, direct conv": lambda x, y: direct.eval()(x).predictions,
                "labml": lambda x, y: labml.eval()(x)[2]}
    if args.no_direct or device.type != "cpu":                               # on a GPU "auto" is already direct
        for d in (models, train_fns, eval_fns): d.pop("ours, direct conv")
    results = {}
    for kind, fns in (("train", train_fns), ("eval", eval_fns)):
        times = {k: [] for k in fns}
        for name, fn in fns.items():                                       # warm-up
            if kind == "train": models[name].train()
            with torch.set_grad_enabled(kind == "train"): fn(*batches[0])
        for r in range(args.rounds):
            for name, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
                if kind == "train": models[name].train()
                sync(); t0 = time.perf_counter()
                with torch.set_grad_enabled(kind == "train"):
                    for s in range(args.steps): fn(*batches[(r * args.steps + s) % len(batches)])
                sync(); times[name].append(args.steps * args.batch_size / (time.perf_counter() - t0))
        results[kind] = {k: round(statistics.median(v), 2) for k, v in times.items()}
        o, s = results[kind]["ours"], results[kind]["labml"]
        print(f"{kind:5s} images/s (batch {args.batch_size}, {device}, {torch.get_num_threads()} threads, median of "
              f"{args.rounds} rounds x {args.steps} steps): ours {o:8.1f}   labml {s:8.1f}   ratio {o / s:.2f}x", flush=True)
        if "ours, direct conv" in results[kind]:
            d = results[kind]["ours, direct conv"]
            print(f"{'':5s} ours with PrimaryCaps by F.conv2d (no Fourier form): {d:8.1f}   ratio to labml's {d / s:.2f}x",
                  flush=True)
    return results


def time_to_accuracy(args, device):
    "Each model trained its own way until --target test accuracy: {name: {evals: [...], reached, steps, minutes}}."
    report = {}
    x_tr, y_tr = load_mnist(True)
    x_te, y_te = load_mnist(False)
    test = MNISTBatches(x_te, y_te, 500, device=device)
    for name in ("ours", "labml"):
        torch.manual_seed(0)
        if name == "ours":
            model = CapsNet(3).to(device)
            opt = torch.optim.Adam(model.parameters(), 1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
            margin = MarginLoss(10)
            step = lambda x, y: ours_step(model.train(), opt, sched, margin, x, y)
            predict = lambda x: model.eval()(x).predictions
            train = MNISTBatches(x_tr, y_tr, 128, shuffle=True, max_shift=2, device=device)
        else:
            model = LabmlCapsNet().to(device)
            opt = torch.optim.Adam(model.parameters(), 1e-3)
            s_margin, mse = LabmlMarginLoss(n_labels=10), nn.MSELoss()
            step = lambda x, y: labml_step(model.train(), opt, s_margin, mse, x, y)
            predict = lambda x: model.eval()(x)[2]
            train = MNISTBatches(x_tr, y_tr, 128, shuffle=True, max_shift=0, device=device)
        t_train, steps, acc, epoch, done, evals = 0.0, 0, 0.0, 0, False, []
        while not done:
            train.set_epoch(epoch); epoch += 1
            for x, y in train:
                t0 = time.perf_counter(); step(x, y); t_train += time.perf_counter() - t0; steps += 1
                if steps % args.eval_every == 0:
                    acc = accuracy(predict, test)
                    evals.append({"step": steps, "minutes": round(t_train / 60, 2), "test_accuracy": acc})
                    print(f"  {name}: step {steps}, {t_train / 60:.1f} min training, test accuracy {acc:.2%}", flush=True)
                    if acc >= args.target or t_train / 60 > args.max_minutes:
                        done = True; break
        verdict = "reached" if acc >= args.target else "did not reach"
        print(f"{name}: {verdict} {args.target:.1%} after {steps} steps ({steps * 128 / 60000:.2f} epochs), "
              f"{t_train / 60:.1f} min of training", flush=True)
        report[name] = {"evals": evals, "reached": acc >= args.target, "steps": steps,
                        "minutes": round(t_train / 60, 2)}
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-direct", action="store_true", help="skip ours with PrimaryCaps by F.conv2d (CPU only)")
    p.add_argument("--full", action="store_true", help="also time both models to --target test accuracy")
    p.add_argument("--target", type=float, default=0.99)
    p.add_argument("--eval-every", type=int, default=235)
    p.add_argument("--max-minutes", type=float, default=240)
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = p.parse_args()
    if args.threads: torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    print(f"CPU: {cpu_name()}", flush=True)
    report = {"settings": {"batch_size": args.batch_size, "device": str(device), "cpu": cpu_name(),
                           "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps},
              "images_per_s": throughput(args, device)}
    if args.full:
        report["time_to_accuracy"] = {"target": args.target, **time_to_accuracy(args, device)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
