"""Appendix H's fused kernel for the image SCAE: Eqs. (10.4) and (10.5) in C++, against Chapter 10's
PyTorch path (the same log-likelihood and gradients), the model's training step through it, and its
fallbacks (turned off, unbuildable, non-finite poses). The kernel is built with this machine's C++
compiler: on a machine without one, these tests are skipped (they are not passes)."""
import shutil
import warnings

import pytest
import torch

from capsule_book import pcae
from capsule_book.data import CanvasBatches, load_mnist
from capsule_book.pcae import (TemplateDecoder, pixel_mixture_extension, pixel_mixture_log_likelihood,
                               placed_mixture_log_likelihood, transform_templates)
from capsule_book.scae import SCAE, SCAEConfig
from capsule_book.utils import round_off

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler on this machine: the fused kernel cannot be built", allow_module_level=True)

SMALL = dict(n_parts=5, n_objects=4, n_object_params=8, n_hidden=16, set_out=16, set_dim=8)


@pytest.fixture(scope="module")
def built():
    ext = pixel_mixture_extension()
    assert ext is not None, "a machine with a C++ compiler must build the fused kernel"
    return ext


def _case(seed, B=6, N=7, t=11, W=40):
    "Poses inside, across and off the canvas (scaled, sheared, flipped); presences down to 0."
    g = torch.Generator().manual_seed(seed)
    templates = torch.cat([torch.rand(N, 1, t, t, generator=g),
                           torch.randn(N, 1, t, t, generator=g)], 1).requires_grad_()
    pose = torch.eye(3).repeat(B, N, 1, 1)
    pose[..., :2, :2] = 0.4 * torch.randn(B, N, 2, 2, generator=g) + 0.4 * torch.eye(2)
    pose[..., :2, 2] = torch.randn(B, N, 2, generator=g)
    presence = torch.rand(B, N, generator=g)
    presence[0, :2] = 0.0
    inputs = {"templates": templates, "pose": pose.requires_grad_(),
              "presence": presence.requires_grad_(), "colour": torch.rand(B, N, generator=g).requires_grad_(),
              "bg_mean": torch.rand(1, generator=g).requires_grad_(),
              "bg_logit": torch.randn(1, generator=g).requires_grad_()}
    return inputs, torch.rand(B, 1, W, W, generator=g)


def _chapter_10(i, image, sigma):
    placed = transform_templates(i["templates"], i["pose"], image.shape[-1])
    means = placed[:, :, 0] * i["colour"][..., None, None]
    logits = placed[:, :, 1] + i["presence"].clamp_min(1e-16).log()[..., None, None]
    return pixel_mixture_log_likelihood(image, means, logits, i["bg_mean"], i["bg_logit"], sigma)


@pytest.mark.parametrize("seed,sigma,W", [(0, 1.0, 40), (1, 0.25, 40), (2, 1.0, 17)])
def test_kernel_is_chapter_10_with_every_gradient(built, seed, sigma, W):
    inputs, image = _case(seed, W=W)
    ref = _chapter_10(inputs, image, sigma)
    out = placed_mixture_log_likelihood(*(inputs[k] for k in ("templates", "pose", "presence", "colour")),
                                        image, inputs["bg_mean"], inputs["bg_logit"], sigma)
    assert (out - ref).abs().max() <= round_off(ref, 8 * W * W)
    w = torch.randn(len(ref), generator=torch.Generator().manual_seed(seed))   # an uneven ∂L/∂log p
    for name, a, b in zip(inputs, torch.autograd.grad((ref * w).sum(), list(inputs.values())),
                          torch.autograd.grad((out * w).sum(), list(inputs.values()))):
        assert (b - a).abs().max() <= 1e-4 * a.abs().max(), name


def test_training_step_runs_the_kernel_and_matches_the_pytorch_path(built, monkeypatch):
    x, y = load_mnist(True, sample=True)
    images = next(iter(CanvasBatches(x, y, batch_size=8, shuffle=True, seed=0)))[0]
    model = SCAE(SCAEConfig(**SMALL), seed=0).train()
    calls = []
    monkeypatch.setattr(pcae, "placed_mixture_log_likelihood",
                        lambda *a, **k: calls.append(1) or placed_mixture_log_likelihood(*a, **k))
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(TemplateDecoder, "fused", fused)
        torch.manual_seed(0)                                       # the same training noise
        model.zero_grad()
        loss = model(images).loss
        loss.backward()
        runs[fused] = loss.item(), [p.grad.clone() for p in model.parameters()]
    assert len(calls) == 1                                         # the kernel ran in the fused step only
    (l0, g0), (l1, g1) = runs[False], runs[True]
    assert l1 == pytest.approx(l0, rel=1e-5)
    for a, b in zip(g0, g1):
        assert (b - a).abs().max() <= 1e-3 * a.abs().max() + 1e-7
    model.eval()                                                  # evaluation: Chapter 10's components
    out = model(images)
    assert out.means is not None and out.means.shape == (8, SMALL["n_parts"] + 1, 40, 40)


def test_fallbacks_turned_off_unbuildable_and_non_finite(built, monkeypatch):
    inputs, image = _case(3, B=2, N=3)
    dec = TemplateDecoder(n_parts=3).train()
    args = (image, inputs["pose"].detach(), inputs["presence"].detach(), inputs["colour"].detach())
    assert dec(*args)[1] is None                                  # fused: no per-pixel components
    monkeypatch.setenv("CAPSULE_BOOK_FUSED", "0")
    assert pixel_mixture_extension() is None and dec(*args)[1] is not None
    monkeypatch.delenv("CAPSULE_BOOK_FUSED")
    bad = inputs["pose"].detach().clone()
    bad[1, 0, 0, 0] = float("nan")                                # no crash: Chapter 10's path, NaN out
    ll, means, _ = dec(image, bad, *args[2:])
    assert means is not None and torch.isnan(ll[1]) and torch.isfinite(ll[0])
    # a kernel that cannot be built: a warning, and the PyTorch path
    monkeypatch.setattr(pcae, "_PIXEL_MIXTURE", {})
    monkeypatch.setattr(pcae, "_PIXEL_MIXTURE_FLAGS", ("-fno-such-flag-for-this-test",))
    with pytest.warns(UserWarning, match="could not be built"):
        assert pixel_mixture_extension() is None
    assert dec(*args)[1] is not None
