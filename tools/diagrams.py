#!/usr/bin/env python
"""Draw the book's diagrams as SVG into nbs/images/.

    python tools/diagrams.py            # writes nbs/images/{capsnet,routing,set_transformer,ccae,
                                        #   squash,constellations,gmm,scae}.svg
    python tools/diagrams.py --png /tmp # also writes PNG previews there
    python tools/diagrams.py --only gmm # only the figures named

Pure matplotlib (no external assets), deterministic: the same bytes on every run.
Colours are shared by all the figures: grey = data, blue = convolutions, orange = capsules,
green = routing, purple = attention, yellow = mixture, pink = decoder, red = losses.
"""
from __future__ import annotations

import argparse
import html
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, PathPatch  # noqa: E402
from matplotlib.path import Path as MPath  # noqa: E402
from matplotlib.textpath import TextPath  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "nbs" / "images"

RC = {
    "svg.fonttype": "none",          # text stays text: small files, selectable labels
    "svg.hashsalt": "capsule_book",  # deterministic ids
    "svg.image_inline": True,
    "font.family": "DejaVu Sans",
    "mathtext.fontset": "dejavusans",
    "font.size": 9,
    "path.simplify": True,
}

# (fill, edge) per kind of node; the same meaning in every figure
PALETTE = {
    "data": ("#f1f1f1", "#5c5c5c"),
    "conv": ("#dbe8f6", "#2463a6"),
    "caps": ("#fde7cc", "#c0620a"),
    "route": ("#d9f0e5", "#1d7d58"),
    "attn": ("#e7e2f4", "#5a4aa0"),
    "mix": ("#fdf3c4", "#8c6e00"),
    "dec": ("#f5e1eb", "#9b3d6f"),
    "loss": ("#f9dcd5", "#b2391d"),
    "plain": ("#ffffff", "#5c5c5c"),
}
INK = "#333333"
SHAPE_INK = "#444444"
MONO = "DejaVu Sans Mono"
J_COLOURS = ("#2463a6", "#c0620a", "#1d7d58")   # upper capsules / object capsules k = 1, 2, 3


# ----------------------------------------------------------------------------------------------- helpers
@dataclass
class Box:
    "A drawn box in inch coordinates, with its anchors."
    cx: float
    cy: float
    w: float
    h: float
    texts: list = field(default_factory=list)

    @property
    def l(self) -> float: return self.cx - self.w / 2
    @property
    def r(self) -> float: return self.cx + self.w / 2
    @property
    def t(self) -> float: return self.cy + self.h / 2
    @property
    def b(self) -> float: return self.cy - self.h / 2
    def top(self, dx: float = 0.0) -> tuple[float, float]: return (self.cx + dx, self.t)
    def bottom(self, dx: float = 0.0) -> tuple[float, float]: return (self.cx + dx, self.b)
    def left(self, dy: float = 0.0) -> tuple[float, float]: return (self.l, self.cy + dy)
    def right(self, dy: float = 0.0) -> tuple[float, float]: return (self.r, self.cy + dy)


class Canvas:
    "A figure whose single axes is measured in inches from the bottom-left corner."

    def __init__(self, w: float, h: float):
        self.fig = Figure(figsize=(w, h))
        FigureCanvasAgg(self.fig)
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, w)
        self.ax.set_ylim(0, h)
        self.ax.set_axis_off()
        self.boxes: list[Box] = []
        self.free_texts: list = []

    def text(self, x: float, y: float, s: str, size: float = 8.5, color: str = INK, ha: str = "center",
             va: str = "center", weight: str = "normal", family: Optional[str] = None, check: bool = True,
             **kw):
        t = self.ax.text(x, y, s, fontsize=size, color=color, ha=ha, va=va, weight=weight,
                         family=family or RC["font.family"], **kw)
        if check:
            self.free_texts.append(t)
        return t

    def path_text(self, x: float, y: float, s: str, size: float = 8.5, color: str = INK, zorder: float = 3):
        "Text drawn as outlines, centred on (x, y): for symbols no browser font has, such as $\\mathcal{N}$."
        tp = TextPath((0, 0), s, size=size / 72, prop=FontProperties(family=RC["font.family"]))
        ext = tp.get_extents()
        verts = tp.vertices - (ext.x0 + ext.width / 2, ext.y0 + ext.height / 2) + (x, y)
        patch = PathPatch(MPath(verts, tp.codes), fc=color, lw=0, zorder=zorder)
        self.ax.add_patch(patch)
        return patch

    def shape(self, x: float, y: float, s: str, ha: str = "left", va: str = "center", size: float = 8, **kw):
        "A tensor shape label, in monospace."
        return self.text(x, y, s, size=size, color=SHAPE_INK, ha=ha, va=va, family=MONO, **kw)

    def box(self, cx: float, cy: float, w: float, h: float, title: str = "", detail: str = "",
            kind: str = "plain", title_size: float = 9.5, detail_size: float = 8, text_dx: float = 0.0,
            lw: float = 1.2, ls: str = "-", rounding: float = 0.07, alpha: float = 1.0,
            detail_as_path: bool = False) -> Box:
        "A rounded box with a bold title line and an optional detail line."
        fill, edge = PALETTE[kind]
        patch = FancyBboxPatch((cx - w / 2, cy - h / 2), w, h, boxstyle=f"round,pad=0,rounding_size={rounding}",
                               fc=fill, ec=edge, lw=lw, ls=ls, alpha=alpha, zorder=2)
        self.ax.add_patch(patch)
        b = Box(cx, cy, w, h)
        x = cx + text_dx
        if title and detail:
            gap = 0.1 + 0.006 * (title_size + detail_size - 17.5)
            b.texts.append(self.text(x, cy + gap, title, size=title_size, weight="bold", check=False, zorder=3))
            if detail_as_path:
                b.texts.append(self.path_text(x, cy - gap - 0.01, detail, size=detail_size))
            else:
                b.texts.append(self.text(x, cy - gap - 0.01, detail, size=detail_size, check=False, zorder=3))
        elif title:
            b.texts.append(self.text(x, cy, title, size=title_size, weight="bold", check=False, zorder=3))
        self.boxes.append(b)
        return b

    def arrow(self, *pts: tuple[float, float], color: str = INK, lw: float = 1.1, ls: str = "-",
              head: bool = True, ms: float = 9, zorder: float = 1.5):
        "A polyline through `pts` with an arrow head at the end."
        codes = [MPath.MOVETO] + [MPath.LINETO] * (len(pts) - 1)
        style = "-|>" if head else "-"
        p = FancyArrowPatch(path=MPath(pts, codes), arrowstyle=style, mutation_scale=ms, lw=lw, ls=ls,
                            color=color, joinstyle="miter", capstyle="butt", zorder=zorder)
        self.ax.add_patch(p)
        return p

    def plus(self, x: float, y: float, r: float = 0.11) -> tuple[float, float]:
        "A residual-sum node ⊕."
        self.ax.add_patch(Circle((x, y), r, fc="white", ec=INK, lw=1.1, zorder=3))
        self.ax.plot([x - r * 0.6, x + r * 0.6], [y, y], color=INK, lw=1.1, zorder=4)
        self.ax.plot([x, x], [y - r * 0.6, y + r * 0.6], color=INK, lw=1.1, zorder=4)
        return (x, y)

    def check(self, name: str) -> list[str]:
        "Problems: text outside its box, or text overlapping other text or a box it does not belong to."
        renderer = self.fig.canvas.get_renderer()
        inv = self.ax.transData.inverted()

        def ext(t):
            bb = t.get_window_extent(renderer)
            (x0, y0), (x1, y1) = inv.transform([[bb.x0, bb.y0], [bb.x1, bb.y1]])
            return x0, y0, x1, y1

        def overlap(a, b, eps=0.0):
            return a[0] < b[2] - eps and b[0] < a[2] - eps and a[1] < b[3] - eps and b[1] < a[3] - eps

        problems = []
        W, H = self.fig.get_size_inches()
        all_texts = []
        for bx in self.boxes:
            for t in bx.texts:
                e = ext(t)
                all_texts.append((t, e))
                if e[0] < bx.l + 0.03 or e[2] > bx.r - 0.03 or e[1] < bx.b + 0.01 or e[3] > bx.t - 0.01:
                    problems.append(f"{name}: text {_label(t)!r} does not fit its box")
        for t in self.free_texts:
            e = ext(t)
            all_texts.append((t, e))
            for bx in self.boxes:
                if overlap(e, (bx.l, bx.b, bx.r, bx.t), 0.01):
                    problems.append(f"{name}: text {_label(t)!r} overlaps a box")
        for t, e in all_texts:
            if e[0] < 0.02 or e[1] < 0.02 or e[2] > W - 0.02 or e[3] > H - 0.02:
                problems.append(f"{name}: text {_label(t)!r} leaves the figure")
        for i, (t, e) in enumerate(all_texts):
            for u, f in all_texts[i + 1:]:
                if overlap(e, f, 0.005):
                    problems.append(f"{name}: texts {_label(t)!r} and {_label(u)!r} overlap")
        return problems


def _label(artist) -> str:
    return artist.get_text() if hasattr(artist, "get_text") else "(text drawn as a path)"


def digit(blur: float = 0.0) -> np.ndarray:
    "A synthetic 28×28 handwritten-looking 7 (no external data); `blur` > 0 smooths it like a reconstruction."
    yy, xx = np.mgrid[0:28, 0:28].astype(float)
    strokes = [((6.5, 7.0), (21.0, 6.0)), ((21.0, 6.0), (16.0, 14.5)), ((16.0, 14.5), (11.5, 22.5)),
               ((10.5, 13.5), (19.5, 13.0))]
    d = np.full(xx.shape, np.inf)
    for (x0, y0), (x1, y1) in strokes:
        px, py = xx - x0, yy - y0
        vx, vy = x1 - x0, y1 - y0
        s = np.clip((px * vx + py * vy) / (vx * vx + vy * vy), 0, 1)
        d = np.minimum(d, np.hypot(px - s * vx, py - s * vy))
    img = np.clip(2.2 - d, 0, 1.6) / 1.6
    if blur > 0:
        k = np.exp(-0.5 * (np.arange(-3, 4) / blur) ** 2)
        k /= k.sum()
        img = np.apply_along_axis(lambda r: np.convolve(r, k, "same"), 0, img)
        img = np.apply_along_axis(lambda r: np.convolve(r, k, "same"), 1, img)
        img = np.clip(img / img.max() * 1.1, 0, 1)
    return np.round(img * 15) / 15      # few grey levels: a small embedded PNG


def thumbnail(c: Canvas, img: np.ndarray, cx: float, cy: float, size: float):
    c.ax.imshow(img, cmap="gray", vmin=0, vmax=1, interpolation="nearest", zorder=3,
                extent=(cx - size / 2, cx + size / 2, cy - size / 2, cy + size / 2))
    c.ax.add_patch(FancyBboxPatch((cx - size / 2, cy - size / 2), size, size, boxstyle="square,pad=0",
                                  fc="none", ec="#5c5c5c", lw=0.6, zorder=4))


# ----------------------------------------------------------------------------------------------- 1. CapsNet
def capsnet() -> Canvas:
    "The CapsNet of Sabour et al. (2017), encoder down the left, decoder up the right, with tensor shapes."
    W, H = 8.5, 7.55
    c = Canvas(W, H)
    lx, rx, bw, bh = 1.82, 6.68, 3.04, 0.56
    ys = [7.05 - 0.86 * k for k in range(7)]
    # encoder
    img_dx = -bw / 2 + 0.34
    inp = c.box(lx, ys[0], bw, bh, "input image $x$", "a 28×28 grey-scale MNIST digit", "data", text_dx=0.3)
    thumbnail(c, digit(), lx + img_dx, ys[0], 0.44)
    conv = c.box(lx, ys[1], bw, bh, "Conv1", "9×9 convolution, 256 channels, ReLU", "conv")
    prim = c.box(lx, ys[2], bw, bh, "PrimaryCaps", "9×9 conv, stride 2: 32 types × 8-D", "conv")
    caps = c.box(lx, ys[3], bw, bh, "1152 primary capsules $u_i$", "32·6·6 vectors of 8-D, squashed (Eq. 1)",
                 "caps")
    pred = c.box(lx, ys[4], bw, bh, r"predictions $\hat{u}_{j|i} = W_{ij}\,u_i$",
                 r"one $W_{ij}$ (8→16) per pair $(i, j)$, $j$ = 1…10", "caps")
    rout = c.box(lx, ys[5], bw, bh, "dynamic routing", "routing by agreement, 3 iterations", "route")
    digc = c.box(lx, ys[6], bw, bh, "DigitCaps $v_j$", "10 capsules × 16-D, one per digit class", "caps")
    lens = c.box(lx, 0.62, bw, bh, r"lengths $\|v_j\|$", "= class probabilities", "caps")
    shapes = ["[B,1,28,28]", "[B,256,20,20]", "[B,256,6,6]", "$u_i$ [B,1152,8]",
              r"$\hat{u}_{j|i}$ [B,1152,10,16]", "$v_j$ [B,10,16]"]
    chain = [inp, conv, prim, caps, pred, rout, digc]
    for a, b, s in zip(chain, chain[1:], shapes):
        c.arrow(a.bottom(), b.top())
        c.shape(lx + 0.1, (a.b + b.t) / 2, s)
    c.arrow(digc.bottom(), lens.top())
    c.shape(lx + 0.1, (digc.b + lens.t) / 2, "[B,10]")
    c.text(lx - 0.1, (caps.t + prim.b) / 2, "reshape", size=7.5, ha="right", color="#666666")
    # losses
    margin = c.box(rx, 0.62, bw, bh, "margin loss (Eq. 4)",
                   r"$T_k\,\max(0,\,0.9-\|v_k\|)^2 + 0.5\,(1-T_k)\max(0,\,\|v_k\|-0.1)^2$", "loss",
                   detail_size=7.6)
    c.arrow(lens.right(), margin.left())
    c.text((lens.r + margin.l) / 2, lens.cy + 0.13, "labels $T_k$", size=7.5, color="#666666")
    # decoder, bottom to top on the right
    dys = np.linspace(ys[6], ys[0], 5)
    mask = c.box(rx, dys[0], bw, bh, "mask",
                 r"keep $v_y$: label $y$ (training), $\mathrm{argmax}_j \|v_j\|$ (test)", "dec", detail_size=7.6)
    fc1 = c.box(rx, dys[1], bw, bh, "FC 512, ReLU", "", "dec")
    fc2 = c.box(rx, dys[2], bw, bh, "FC 1024, ReLU", "", "dec")
    fc3 = c.box(rx, dys[3], bw, bh, "FC 784, sigmoid", "", "dec")
    rec = c.box(rx, dys[4], bw, bh, r"reconstruction $\hat{x}$", "the digit drawn back from $v_y$", "data",
                text_dx=0.3)
    thumbnail(c, digit(blur=1.1), rx + img_dx, dys[4], 0.44)
    c.arrow(digc.right(), mask.left())
    c.shape((digc.r + mask.l) / 2, digc.cy + 0.13, "[B,10,16]", ha="center")
    dec = [mask, fc1, fc2, fc3, rec]
    for a, b, s in zip(dec, dec[1:], ["[B,160]", "[B,512]", "[B,1024]", "[B,784] → [B,1,28,28]"]):
        c.arrow(a.top(), b.bottom())
        c.shape(rx + 0.1, (a.t + b.b) / 2, s)
    c.text(rx - 0.1, (mask.t + fc1.b) / 2, "10 × 16, all but $v_y$ zeroed", size=7.5, ha="right",
           color="#666666")
    # prediction used for masking at test time
    c.arrow((lens.r, lens.cy + 0.14), (lens.r + 0.35, lens.cy + 0.14), (lens.r + 0.35, mask.b + 0.12),
            (mask.l, mask.b + 0.12), ls=(0, (3, 2)), lw=1.0, color="#777777")
    c.text(lens.r + 0.43, (lens.t + mask.b) / 2 + 0.06, "argmax\n(test)", size=7.5, ha="left",
           color="#666666")
    # reconstruction loss between x and x̂
    rl = c.box(W / 2, ys[0], 1.44, bh, "reconstruction", r"loss $0.0005\,\|x-\hat{x}\|^2$", "loss",
               title_size=8.5, detail_size=7.5)
    c.arrow(inp.right(), rl.left(), ms=7)
    c.arrow(rec.left(), rl.right(), ms=7)
    return c


# ----------------------------------------------------------------------------------------------- 2. routing
def _toy_routing(iterations: int = 3):
    "Procedure 1 on a toy: 5 lower capsules vote (in 2-D) for 2 upper ones; û [5,2,2], c [5,2], v [2,2] at the end."
    ang = np.deg2rad
    def vec(deg, r): return r * np.array([np.cos(ang(deg)), np.sin(ang(deg))])
    u_hat = np.array([[vec(32, 1.9), vec(200, 0.9)],
                      [vec(42, 2.0), vec(300, 0.8)],
                      [vec(25, 1.8), vec(110, 0.7)],
                      [vec(140, 0.8), vec(-35, 1.9)],
                      [vec(250, 0.9), vec(-25, 2.0)]])              # [i, j, 2]
    b = np.zeros(u_hat.shape[:2])
    for r in range(iterations):
        cc = np.exp(b) / np.exp(b).sum(1, keepdims=True)             # Eq. 3, softmax over j
        s = (cc[..., None] * u_hat).sum(0)                           # Eq. 2
        n2 = (s ** 2).sum(-1, keepdims=True)
        v = n2 / (1 + n2) * s / np.sqrt(n2)                          # Eq. 1
        if r < iterations - 1:
            b = b + (u_hat * v[None]).sum(-1)
    return u_hat, cc, v


def routing() -> Canvas:
    "One iteration of routing by agreement (Procedure 1 of Sabour et al. 2017) and a toy example of its result."
    W, H = 8.5, 5.5
    c = Canvas(W, H)
    # --- left: toy example, arrow width = c_ij
    u_hat, cc, v = _toy_routing()
    c.text(1.8, 5.28, "toy example: 5 lower capsules $i$, 2 upper capsules $j$", size=8.5, weight="bold")
    c.text(1.8, 4.98, r"line width $\propto c_{ij}$ after 3 iterations; $\Sigma_j\, c_{ij} = 1$", size=8)
    lo_x, up_x = 0.42, 1.95
    lo_y = np.linspace(4.2, 0.85, 5)
    up_y = [3.5, 1.55]
    for i, y in enumerate(lo_y):
        for j, yj in enumerate(up_y):
            c.ax.plot([lo_x + 0.2, up_x - 0.3], [y, yj], color=J_COLOURS[j], lw=0.4 + 7 * cc[i, j],
                      alpha=0.85, solid_capstyle="butt", zorder=1)
    for i, y in enumerate(lo_y):
        c.ax.add_patch(Circle((lo_x, y), 0.2, fc=PALETTE["caps"][0], ec=PALETTE["caps"][1], lw=1.1, zorder=3))
        c.text(lo_x, y, f"$u_{i + 1}$", size=9, check=False, zorder=4)
    r_vote = 0.5
    for j, yj in enumerate(up_y):
        c.ax.add_patch(Circle((up_x, yj), 0.3, fc="white", ec=J_COLOURS[j], lw=1.6, zorder=3))
        c.text(up_x, yj, f"$v_{j + 1}$", size=10, check=False, zorder=4)
        # its votes û_{j|i} (grey, width ∝ c_ij) and v_j (colour), on the same scale, in a little 2-D plot
        ox, oy = up_x + 0.95, yj
        c.ax.add_patch(Circle((ox, oy), r_vote + 0.1, fc="#fafafa", ec="#bbbbbb", lw=0.6, zorder=1))
        scale = r_vote / 2.05
        for i in range(5):
            d = u_hat[i, j] * scale
            c.arrow((ox, oy), (ox + d[0], oy + d[1]), color="#6f6f6f", lw=0.5 + 1.2 * cc[i, j], ms=6, zorder=2)
        d = v[j] * scale
        c.arrow((ox, oy), (ox + d[0], oy + d[1]), color=J_COLOURS[j], lw=2.6, ms=10, zorder=3)
        c.text(ox, oy - r_vote - 0.27, rf"votes $\hat{{u}}_{{{j + 1}|i}}$ (grey), $v_{j + 1}$", size=7.5,
               color="#555555")
    # --- right: the loop of Procedure 1
    bx, bw, bh = 5.78, 3.24, 0.56
    c.text(bx, 5.28, "routing by agreement (Procedure 1): one iteration", size=8.5, weight="bold")
    ys = [4.72 - 0.82 * k for k in range(6)]
    init = c.box(bx, ys[0], bw, bh, r"$b_{ij} \leftarrow 0$",
                 r"for every pair $(i, j)$; input: votes $\hat{u}_{j|i}$", "data")
    coup = c.box(bx, ys[1], bw, bh, r"$c_{ij} = \mathrm{softmax}_j\,(b_{ij})$",
                 r"Eq. 3: over the output capsules $j$, $\Sigma_j\, c_{ij} = 1$", "route")
    tot = c.box(bx, ys[2], bw, bh, r"$s_j = \sum_i\, c_{ij}\,\hat{u}_{j|i}$",
                "Eq. 2: the votes weighted by coupling", "route")
    sq = c.box(bx, ys[3], bw, bh, r"$v_j = \mathrm{squash}(s_j)$",
               r"Eq. 1: $\|s_j\|^2/(1+\|s_j\|^2)\cdot s_j/\|s_j\|$, so $\|v_j\| < 1$", "caps",
               detail_size=8.2)
    agr = c.box(bx, ys[4], bw, bh, r"$a_{ij} = \hat{u}_{j|i} \cdot v_j$",
                r"agreement of the vote of $i$ with $v_j$", "route")
    upd = c.box(bx, ys[5], bw, bh, r"$b_{ij} \leftarrow b_{ij} + a_{ij}$", "", "route")
    chain = [init, coup, tot, sq, agr, upd]
    sh = ["", "$b$ [B,1152,10]", "$c$ [B,1152,10]", "$s$ [B,10,16]", "$v$ [B,10,16]", "$a$ [B,1152,10]"]
    for a, b, s in zip(chain, chain[1:], sh[1:]):
        c.arrow(a.bottom(), b.top())
        c.shape(bx + 0.1, (a.b + b.t) / 2, s, size=7.5)
    # loop back on the left: the next iteration
    green = PALETTE["route"][1]
    lx = bx - bw / 2 - 0.26
    c.arrow(upd.left(), (lx, upd.cy), (lx, coup.cy), coup.left(), color=green, lw=1.4)
    c.text(lx - 0.13, (ys[2] + ys[4]) / 2, "next iteration", size=7.5, color=green, rotation=90)
    # output after the last iteration, on the right
    orange = PALETTE["caps"][1]
    c.arrow(sq.right(), (sq.r + 0.3, sq.cy), color=orange, lw=1.4)
    c.text(sq.r + 0.36, sq.cy, "output $v_j$\nafter the\nlast iteration", size=7.5, ha="left", color=orange)
    return c


# ----------------------------------------------------------------------------------------------- 3. Set Transformer
def _mab_icon(c: Canvas, cx: float, cy: float, label: str, w: float = 1.45, h: float = 0.42) -> Box:
    return c.box(cx, cy, w, h, label, "", "attn", title_size=8.5)


def set_transformer() -> Canvas:
    "MAB, SAB, ISAB, PMA and the Set Transformer of Lee et al. (2019), with shapes."
    W, H = 8.5, 7.3
    c = Canvas(W, H)
    grey = "#666666"
    # --- panel 1: MAB(X, Y)
    c.text(0.2, 7.05, "multihead attention block  MAB(X, Y)", size=9.5, weight="bold", ha="left")
    yX, yY, ym = 6.35, 5.55, 5.95
    c.text(0.45, yX, "$X$", size=11, ha="center")
    c.shape(0.45, yX - 0.22, "[B,n,d]", ha="center", size=7.5)
    c.text(0.45, yY, "$Y$", size=11, ha="center")
    c.shape(0.45, yY - 0.22, "[B,m,d]", ha="center", size=7.5)
    mh = c.box(1.9, ym, 1.55, 0.78, "Multihead", "$Q = X$,\n$K = V = Y$", "attn", title_size=9, detail_size=7.8)
    c.arrow((0.72, yX), (mh.l, yX))
    c.arrow((0.72, yY), (mh.l, yY))
    p1 = c.plus(3.1, ym)
    c.arrow(mh.right(), (p1[0] - 0.11, ym))
    c.arrow((0.9, yX), (0.9, 6.72), (p1[0], 6.72), (p1[0], ym + 0.11))      # residual from X
    ln1 = c.box(3.82, ym, 0.95, 0.46, "LayerNorm", "", "plain", title_size=8)
    c.arrow((p1[0] + 0.11, ym), ln1.left())
    c.text(4.43, ym + 0.17, "$H$", size=10)
    ff = c.box(5.3, ym, 0.7, 0.46, "rFF", "", "plain", title_size=8.5)
    c.arrow(ln1.right(), ff.left())
    p2 = c.plus(6.0, ym)
    c.arrow(ff.right(), (p2[0] - 0.11, ym))
    c.arrow((4.55, ym), (4.55, 6.72), (p2[0], 6.72), (p2[0], ym + 0.11))    # residual from H
    ln2 = c.box(6.72, ym, 0.95, 0.46, "LayerNorm", "", "plain", title_size=8)
    c.arrow((p2[0] + 0.11, ym), ln2.left())
    c.arrow(ln2.right(), (7.6, ym))
    c.text(7.65, ym + 0.1, "MAB(X, Y)", size=8.5, ha="left")
    c.shape(7.65, ym - 0.14, "[B,n,d]", size=7.5)
    c.text(4.25, 5.2, r"$H = \mathrm{LayerNorm}(X + \mathrm{Multihead}(X, Y, Y))$,     "
           r"$\mathrm{MAB}(X, Y) = \mathrm{LayerNorm}(H + \mathrm{rFF}(H))$", size=8.5)
    c.text(4.25, 4.93, "one output row per row of $X$ (the queries); $Y$ gives the keys and values; "
           "rFF acts on each row alone",
           size=7.8, color=grey)
    # --- panel 2: SAB, ISAB, PMA
    top, base = 4.5, 2.55
    c.ax.plot([0.2, 8.3], [4.72, 4.72], color="#dddddd", lw=0.8)
    # SAB
    c.text(1.25, top, "SAB(X) = MAB(X, X)", size=9, weight="bold")
    sx = 1.25
    c.text(sx, base, "$X$", size=10)
    c.shape(sx + 0.17, base, "[B,n,d]", size=7.5)
    sab = _mab_icon(c, sx, 3.45, "MAB(X, X)", w=1.3)
    c.arrow((sx, base + 0.15), (sx, base + 0.4), (sx - 0.3, base + 0.4), sab.bottom(-0.3))
    c.arrow((sx, base + 0.4), (sx + 0.3, base + 0.4), sab.bottom(0.3))
    c.arrow(sab.top(), (sx, 4.13))
    c.shape(sx + 0.1, 4.0, "[B,n,d]", size=7.5)
    c.text(sx, 2.25, "cost $O(n^2)$", size=7.5, color=grey)
    # ISAB
    ix = 4.2
    c.text(ix, top, "ISAB$_m$(X) = MAB(X, H),  H = MAB(I, X)", size=9, weight="bold")
    xX, xI = ix - 0.85, ix + 0.75
    c.text(xX, base, "$X$", size=10)
    c.shape(xX + 0.17, base, "[B,n,d]", size=7.5)
    c.text(xI, base, "$I$", size=10)
    c.shape(xI + 0.15, base, "[m,d] learned", size=7.5)
    mab1 = _mab_icon(c, xI, 3.0, "MAB(I, X)", w=1.25)
    mab2 = _mab_icon(c, xX, 3.72, "MAB(X, H)", w=1.25)
    c.arrow((xI, base + 0.15), mab1.bottom())
    c.arrow((xX + 0.15, base + 0.1), (mab1.l, mab1.cy - 0.08))
    c.arrow((xX, base + 0.15), mab2.bottom(-0.0))
    c.arrow(mab1.top(), (xI, mab2.cy), mab2.right())
    c.text(xI + 0.1, 3.5, "$H$", size=9, ha="left")
    c.shape(xI + 0.3, 3.5, "[B,m,d]", size=7.5)
    c.arrow(mab2.top(), (xX, 4.17))
    c.shape(xX + 0.1, 4.08, "[B,n,d]", size=7.5)
    c.text(ix, 2.25, "cost $O(nm)$ with $m$ inducing points", size=7.5, color=grey)
    # PMA
    px = 7.2
    c.text(px, top, "PMA$_k$(Z) = MAB(S, rFF(Z))", size=9, weight="bold")
    xZ, xS = px - 0.55, px + 0.55
    c.text(xZ, base, "$Z$", size=10)
    c.shape(xZ + 0.17, base, "[B,n,d]", size=7.5)
    c.text(xS, base, "$S$", size=10)
    c.shape(xS + 0.15, base, "[k,d]", size=7.5)
    rff = c.box(xZ, 3.0, 0.62, 0.34, "rFF", "", "plain", title_size=8)
    pma = _mab_icon(c, px, 3.72, "MAB(S, rFF(Z))", w=1.5)
    c.arrow((xZ, base + 0.15), rff.bottom())
    c.arrow(rff.top(), pma.bottom(-0.55))
    c.arrow((xS, base + 0.15), pma.bottom(0.55))
    c.arrow(pma.top(), (px, 4.17))
    c.shape(px + 0.1, 4.08, "[B,k,d]", size=7.5)
    c.text(px, 2.25, "$k$ learned seed vectors $S$", size=7.5, color=grey)
    # --- panel 3: the network
    c.ax.plot([0.2, 8.3], [1.98, 1.98], color="#dddddd", lw=0.8)
    c.text(0.2, 1.75, "Set Transformer", size=9.5, weight="bold", ha="left")
    y = 1.05
    c.text(0.42, y + 0.08, "$X$", size=11)
    c.shape(0.42, y - 0.17, "[B,n,d]", ha="center", size=7.5)
    enc = c.box(1.95, y, 1.75, 0.56, "encoder", r"2 × SAB (or ISAB$_m$)", "attn", title_size=9, detail_size=8)
    pm = c.box(4.05, y, 0.85, 0.56, "PMA$_k$", "", "attn", title_size=9)
    sb = c.box(5.6, y, 0.7, 0.56, "SAB", "", "attn", title_size=9)
    li = c.box(6.6, y, 0.78, 0.56, "Linear", "", "plain", title_size=9)
    c.arrow((0.72, y), enc.left())
    c.arrow(enc.right(), pm.left())
    c.shape((enc.r + pm.l) / 2, y + 0.14, "[B,n,128]", ha="center", size=7.5)
    c.arrow(pm.right(), sb.left())
    c.shape((pm.r + sb.l) / 2, y + 0.14, "[B,k,128]", ha="center", size=7.5)
    c.arrow(sb.right(), li.left())
    c.arrow(li.right(), (7.45, y))
    c.shape(7.5, y, "[B,k,d_out]", size=7.5)
    # braces: encoder / decoder
    for x0, x1, label in ((enc.l, enc.r, "permutation-equivariant"),
                          (pm.l, li.r, "decoder: one output row per seed, invariant to the order of $X$")):
        c.ax.plot([x0, x0, x1, x1], [0.6, 0.52, 0.52, 0.6], color=grey, lw=0.8)
        c.text((x0 + x1) / 2, 0.33, label, size=7.5, color=grey)
    return c


# ----------------------------------------------------------------------------------------------- 4. CCAE
def ccae() -> Canvas:
    "The Constellation Capsule Autoencoder of Kosiorek et al. (2019): points → capsules → votes → mixture."
    W, H = 8.5, 6.3
    c = Canvas(W, H)
    lx, bw, bh = 2.5, 4.1, 0.56
    ys = [5.9 - 0.86 * k for k in range(7)]
    pts = c.box(lx, ys[0], bw, bh, "2-D points $x_m$", "the parts of a few shapes, in no order", "data")
    enc = c.box(lx, ys[1], bw, bh, "Set Transformer encoder",
                "Chapter 5: SAB layers, then PMA with $K$ seeds", "attn")
    obj = c.box(lx, ys[2], bw, bh, "$K$ object capsules",
                r"features $c_k$, pose $OV_k$ (3×3), presence $a_k$", "caps")
    vot = c.box(lx, ys[3], bw, bh, "$N$ part votes per capsule",
                r"$\mu_{kn}$ = translation of $OV_k\,OP_{kn}$, scale $\lambda_{kn}$, presence $a_{kn}$",
                "caps", detail_size=7.6)
    mix = c.box(lx, ys[4], bw, bh, r"Gaussian mixture over the $K{\cdot}N$ votes",
                r"$\pi_{kn} = a_k a_{kn} \,/\, \Sigma_{ij}\, a_i a_{ij}$, + a background component", "mix",
                detail_size=7.8)
    ll = c.box(lx, ys[5], bw, 0.66, "log-likelihood (maximised)",
               r"$\sum_m \log \sum_{k,n}\, \pi_{kn}\,\mathcal{N}(x_m \mid \mu_{kn}, \lambda_{kn})$", "loss",
               detail_size=8.2, detail_as_path=True)
    seg = c.box(lx, ys[6] - 0.05, bw, bh, "segmentation",
                r"point $m$ → $\mathrm{argmax}_k\, \Sigma_n\, p(k, n \mid x_m)$, the posterior", "plain")
    chain = [pts, enc, obj, vot, mix, ll]
    labels = ["[B,M,2]", "$c_k$ [B,K,d]", "$OV$ [B,K,3,3], $a_k$ [B,K]",
              r"$\mu$ [B,K,N,2], $\lambda$, $a$ [B,K,N]", ""]
    for a, b, s in zip(chain, chain[1:], labels):
        c.arrow(a.bottom(), b.top())
        if s:
            c.shape(lx + 0.1, (a.b + b.t) / 2, s)
    gx = mix.l - 0.2
    c.arrow(mix.left(), (gx, mix.cy), (gx, seg.cy), seg.left())
    c.shape(gx - 0.03, (ll.cy + seg.cy) / 2 + 0.1, "[B,M]", size=7.5, rotation=90, ha="right")
    # --- inset: a square and a triangle, their votes and the segmentation
    ix0, iy0, iw, ih = 5.2, 0.3, 3.15, 5.88
    c.ax.add_patch(FancyBboxPatch((ix0, iy0), iw, ih, boxstyle="round,pad=0,rounding_size=0.07", fc="#fcfcfc",
                                  ec="#bbbbbb", lw=0.8, zorder=0))
    c.text(ix0 + iw / 2, iy0 + ih - 0.22, "example: $K$ = 3 capsules, $N$ = 4 votes", size=8.5, weight="bold")
    rng = np.random.default_rng(7)
    square = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], float) * 0.45
    tri = np.array([[0, 0.66], [-0.6, -0.36], [0.6, -0.36], [0.75, 0.1]], float)
    # centre of OV_k, its angle, the templates OP_kn, the presences a_kn, a_k and the scales λ_kn
    objects = [((6.2, 4.75), np.deg2rad(15), square, [0.95, 0.9, 0.95, 0.9], 0.95, [0.15, 0.18, 0.14, 0.17]),
               ((7.3, 3.3), np.deg2rad(-20), tri, [0.95, 0.92, 0.9, 0.06], 0.9, [0.17, 0.14, 0.16, 0.2]),
               ((6.3, 2.05), np.deg2rad(40), square * 0.75, [0.4, 0.4, 0.4, 0.4], 0.05, [0.16] * 4)]
    for k, ((cx, cy), th, tmpl, a_kn, a_k, lam) in enumerate(objects):
        R = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
        mu = tmpl @ R.T + (cx, cy)
        col = J_COLOURS[k]
        for axis in R.T * 0.3:                                    # the capsule's pose OV_k: a little frame
            c.arrow((cx, cy), (cx + axis[0], cy + axis[1]), color=col, lw=1.1, ms=6, zorder=2)
        for n, (m, a) in enumerate(zip(mu, a_kn)):
            al = float(np.clip(a_k * a, 0.12, 1))
            c.ax.plot([cx, m[0]], [cy, m[1]], color=col, lw=0.7, ls=":", alpha=al, zorder=1)
            c.ax.add_patch(Circle(m, lam[n], fc="none", ec=col, lw=1.0, alpha=al, zorder=2))
            c.ax.plot(*m, marker="x", ms=5.5, mew=1.4, color=col, alpha=al, zorder=3)
            if k < 2 and a > 0.5:                                 # a point x_m near each likely vote
                p = m + rng.normal(0, 0.05, 2)
                c.ax.plot(*p, marker="o", ms=5.5, mfc=col, mec="black", mew=0.9, zorder=4)
        dy = {0: -0.85, 1: -0.78, 2: -0.72}[k]
        c.text(cx, cy + dy, f"capsule {k + 1}: $a_{k + 1}$ = {a_k:.2f}", size=7.5,
               color=col if k < 2 else "#8a8a8a")
    c.text(6.2 + 0.37, 4.75 + 0.05, "$OV_1$", size=7.5, color=J_COLOURS[0], ha="left")
    c.text(6.95, 3.0, "$OP_{2n}$", size=7.5, color=J_COLOURS[1])
    c.text(8.04, 3.5, "$a_{24}$ ≈ 0", size=7.5, color="#8a8a8a")
    # legend
    ly = 0.98
    lx0 = ix0 + 0.22
    c.ax.plot(lx0, ly, marker="o", ms=5.5, mfc=J_COLOURS[0], mec="black", mew=0.9)
    c.text(lx0 + 0.14, ly, "point $x_m$", size=7.5, ha="left")
    c.ax.plot(lx0 + 1.08, ly, marker="x", ms=5.5, mew=1.4, color=INK)
    c.ax.add_patch(Circle((lx0 + 1.08, ly), 0.13, fc="none", ec=INK, lw=0.9))
    c.text(lx0 + 1.27, ly, r"vote $\mu_{kn}$, radius $\lambda_{kn}$", size=7.5, ha="left")
    c.text(ix0 + iw / 2, 0.62, "colour of a point = its segment; faint = low $a_k a_{kn}$", size=7.5,
           color="#555555")
    return c


# ----------------------------------------------------------------------------------------------- 5. squash
def _squash_norm(n):
    "‖v‖ as a function of ‖s‖ (Eq. 1 of Sabour et al. 2017)."
    n = np.asarray(n, float)
    return n * n / (1 + n * n)


def squash() -> Canvas:
    "Eq. 1 of Sabour et al. (2017): a few vectors s_j before and after squashing, and ‖v‖ against ‖s‖."
    W, H = 8.5, 3.75
    c = Canvas(W, H)
    grey, orange = PALETTE["data"][1], PALETTE["caps"][1]
    norms = [0.4, 0.8, 1.5, 2.5, 4.5]
    angles = np.deg2rad([100, 160, 235, 318, 30])
    # --- left: the inputs s_j, 0.36 in per unit
    o1, k1 = np.array([1.25, 1.62]), 0.41
    c.text(1.45, 3.48, "inputs $s_j$", size=9.5, weight="bold")
    c.text(1.45, 3.22, r"labels: $\|s_j\|$", size=7.5, color="#666666")
    c.ax.add_patch(Circle(o1, k1, fc="none", ec="#9a9a9a", lw=0.8, ls=(0, (3, 2)), zorder=1))
    c.text(o1[0] + 0.02, o1[1] - k1 - 0.11, r"$\|s\| = 1$", size=7, color="#8a8a8a")
    # --- right: the outputs v_j in the unit disc, 1.25 in per unit
    o2, k2 = np.array([6.95, 1.62]), 1.25
    c.text(6.95, 3.48, r"outputs $v_j = \mathrm{squash}(s_j)$", size=9.5, weight="bold")
    c.text(6.95, 3.22, r"labels: $\|v_j\|$", size=7.5, color="#666666")
    c.ax.add_patch(Circle(o2, k2, fc="#fdf6ec", ec=orange, lw=1.0, ls=(0, (4, 2.5)), zorder=1))
    c.text(o2[0], o2[1] - 1.07, r"unit circle, $\|v\| = 1$", size=7, color=orange)
    for n, th in zip(norms, angles):
        u = np.array([np.cos(th), np.sin(th)])
        for o, k, length, col, txt in ((o1, k1, n, grey, f"{n:g}"),
                                       (o2, k2, float(_squash_norm(n)), orange, f"{float(_squash_norm(n)):.2f}")):
            tip = o + u * length * k
            c.arrow(tuple(o), tuple(tip), color=col, lw=1.5, ms=7, zorder=2)
            lab = tip + u * 0.15
            if length * k > 0.9 and o is o2:                  # near the unit circle: beside the arrow
                lab = o + u * length * k * 0.72 + np.array([-u[1], u[0]]) * 0.13
            c.text(lab[0], lab[1], txt, size=7.5, color=col, zorder=3)
    for o in (o1, o2):
        c.ax.plot(*o, marker="o", ms=3, color=INK, zorder=4)
    # --- middle: ‖v‖ against ‖s‖
    x0, y0, sx, sy, smax = 3.55, 1.28, 0.3, 1.35, 5.0        # origin, inches per unit of ‖s‖ and of ‖v‖
    c.text(x0 + smax * sx / 2, 3.48, "Eq. 1", size=9.5, weight="bold")
    c.text(x0 + smax * sx / 2, 3.13,
           r"$v_j = \dfrac{\|s_j\|^2}{1 + \|s_j\|^2}\;\dfrac{s_j}{\|s_j\|}$", size=9.5)
    c.arrow((x0, y0), (x0 + smax * sx + 0.12, y0), color=INK, lw=0.8, ms=6)
    c.arrow((x0, y0), (x0, y0 + 1.0 * sy + 0.2), color=INK, lw=0.8, ms=6)
    for t in range(0, 6):
        c.ax.plot([x0 + t * sx] * 2, [y0, y0 - 0.04], color=INK, lw=0.8)
        c.text(x0 + t * sx, y0 - 0.13, str(t), size=7, color=INK)
    for t, lab in ((0.5, "0.5"), (1.0, "1")):
        c.ax.plot([x0, x0 - 0.04], [y0 + t * sy] * 2, color=INK, lw=0.8)
        c.text(x0 - 0.07, y0 + t * sy, lab, size=7, ha="right")
    c.text(x0 + smax * sx + 0.05, y0 - 0.27, r"$\|s\|$", size=8, ha="right")
    c.text(x0 - 0.12, y0 + 1.0 * sy + 0.2, r"$\|v\|$", size=8, ha="right")
    c.ax.plot([x0, x0 + smax * sx], [y0 + sy] * 2, color="#9a9a9a", lw=0.8, ls=(0, (3, 2)))
    s = np.linspace(0, smax, 101)
    c.ax.plot(x0 + s * sx, y0 + _squash_norm(s) * sy, color=orange, lw=1.6, zorder=2)
    s0 = np.linspace(0, 0.85, 35)
    c.ax.plot(x0 + s0 * sx, y0 + s0 ** 2 * sy, color=INK, lw=0.9, ls=(0, (1.2, 1.5)), zorder=2)
    c.ax.plot(x0 + np.array(norms) * sx, y0 + _squash_norm(norms) * sy, ls="none", marker="o", ms=3.5,
              color=orange, zorder=3)
    c.text(x0 + 0.42, y0 + 0.62, r"$\approx \|s\|^2$ near 0", size=7, color=INK, ha="left")
    c.text(x0 + smax * sx, y0 + sy + 0.12, "→ 1, never reached", size=7, color="#666666", ha="right")
    c.arrow((x0 - 0.45, 0.62), (x0 + smax * sx + 0.55, 0.62), color=orange, lw=1.4, ms=9)
    c.text(x0 + smax * sx / 2, 0.76, "squash, each vector on its own", size=8, color=orange)
    c.text(W / 2, 0.18, "direction kept, length squashed into [0, 1): the probability that the entity exists",
           size=9, weight="bold", color=INK)
    return c


# ----------------------------------------------------------------------------------------------- 6. constellations
# The templates of capsule_book.constellations.PATTERNS (the official constellation.py), in the paper's
# configuration ("square", "triangle", "square"); object k is the k-th of them.
CONSTELLATION_TEMPLATES = (
    ("square", np.array([[3.0, 3.0], [1.0, 1.0], [3.0, 1.0], [1.0, 3.0]])),
    ("triangle", np.array([[1.0, 2.0], [3.0, 1.0], [3.0, 3.0]])),
    ("square", np.array([[3.0, 3.0], [1.0, 1.0], [3.0, 1.0], [1.0, 3.0]])),
)


def _outline(p: np.ndarray) -> np.ndarray:
    "The corners in order around their centre, closed: the shape's outline."
    d = p - p.mean(0)
    q = p[np.argsort(np.arctan2(d[:, 1], d[:, 0]))]
    return np.vstack([q, q[:1]])


def constellations() -> Canvas:
    "The constellation data of Kosiorek et al. (2019), Sec. 2.1, made as in capsule_book.constellations."
    W, H = 8.5, 4.0
    c = Canvas(W, H)
    grey = "#666666"
    # one example: θ, s, t of each object (Eq. 6.1, x = s R(θ) p + t/s) and whether it is kept
    poses = [(np.deg2rad(25), 2.2, np.array([4.0, 16.0]), True),
             (np.deg2rad(-40), 2.6, np.array([10.0, 13.0]), True),
             (np.deg2rad(60), 1.6, np.array([22.0, 15.0]), False)]
    placed = []
    for (_, p), (th, s, t, _) in zip(CONSTELLATION_TEMPLATES, poses):
        R = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
        placed.append(s * p @ R.T + t / s)
    allp = np.vstack(placed)                                   # normalised over the example, absent points too
    lo, hi = allp.min(), allp.max()
    placed = [(x - lo) / (hi - lo) * 2 - 1 for x in placed]
    # --- templates, each in its own frame with the grid 0…4
    fs, fx = 0.8, 0.3
    c.text(fx + 0.7, 3.72, "templates", size=9.5, weight="bold")
    for k, (name, p) in enumerate(CONSTELLATION_TEMPLATES):
        fy = 2.6 - 1.05 * k
        col = J_COLOURS[k]
        c.ax.add_patch(FancyBboxPatch((fx, fy), fs, fs, boxstyle="square,pad=0", fc="white", ec="#bbbbbb",
                                      lw=0.7, zorder=0))
        g = fs / 4
        for i in range(1, 4):
            c.ax.plot([fx + i * g] * 2, [fy, fy + fs], color="#eeeeee", lw=0.5, zorder=0.5)
            c.ax.plot([fx, fx + fs], [fy + i * g] * 2, color="#eeeeee", lw=0.5, zorder=0.5)
        q = fx + p[:, 0] * g, fy + p[:, 1] * g
        ol = _outline(p)
        c.ax.plot(fx + ol[:, 0] * g, fy + ol[:, 1] * g, color=col, lw=0.9, alpha=0.6, zorder=1)
        c.ax.plot(q[0], q[1], ls="none", marker="o", ms=4.5, mfc=col, mec="white", mew=0.5, zorder=2)
        c.text(fx + fs + 0.08, fy + fs - 0.1, name, size=8, color=col, ha="left")
        c.text(fx + fs + 0.08, fy + fs - 0.3, f"object {k}", size=7.5, color=grey, ha="left")
        c.text(fx + fs + 0.08, fy + fs - 0.48, f"{len(p)} points", size=7.5, color=grey, ha="left")
        if k == 0:
            c.text(fx - 0.06, fy, "0", size=6.5, color=grey, ha="right")
            c.text(fx + fs, fy - 0.09, "4", size=6.5, color=grey)
            c.text(fx - 0.06, fy + fs, "4", size=6.5, color=grey, ha="right")
    # --- each placed by its own similarity transform
    def frame(x0, y0, size, title, sub):
        c.ax.add_patch(FancyBboxPatch((x0, y0), size, size, boxstyle="square,pad=0", fc="white",
                                      ec="#bbbbbb", lw=0.7, zorder=0))
        c.text(x0 + size / 2, y0 + size + 0.34, title, size=9.5, weight="bold")
        c.text(x0 + size / 2, y0 + size + 0.12, sub, size=7.5, color=grey)
        return lambda x: (x0 + (x[..., 0] + 1.08) / 2.16 * size, y0 + (x[..., 1] + 1.08) / 2.16 * size)

    ax0, size, ymid = 2.6, 2.1, 2.0
    tr = frame(ax0, ymid - size / 2, size, "each placed by its own transform",
               r"$x = s\,R(\theta)\,p + t/s$  (Eq. 6.1)")
    c.arrow((1.8, ymid), (ax0 - 0.06, ymid), color=INK, lw=1.2)
    xm = (1.8 + ax0) / 2
    c.text(xm, ymid + 0.62, "rotate $\\theta$,", size=8, color=INK)
    c.text(xm, ymid + 0.42, "scale $s$,", size=8, color=INK)
    c.text(xm, ymid + 0.22, "translate $t$", size=8, color=INK)
    c.text(xm, ymid - 0.22, "one draw", size=7.5, color=grey)
    c.text(xm, ymid - 0.4, "per object", size=7.5, color=grey)
    for k, x in enumerate(placed):
        col = J_COLOURS[k]
        kept = poses[k][3]
        ol = tr(_outline(x))
        X, Y = tr(x)
        c.ax.plot(*ol, color=col, lw=0.9, alpha=0.6 if kept else 0.35, ls="-" if kept else (0, (3, 2)), zorder=1)
        if kept:
            c.ax.plot(X, Y, ls="none", marker="o", ms=5.5, mfc=col, mec="white", mew=0.6, zorder=2)
        else:
            c.ax.plot(X, Y, ls="none", marker="o", ms=5.5, mfc="none", mec=col, mew=0.9, alpha=0.45, zorder=2)
    th, s, _, _ = poses[0]
    cx, cy = tr(placed[0].mean(0))
    c.text(cx, cy, rf"$\theta$ = {np.rad2deg(th):.0f}°" + "\n" + f"$s$ = {s:g}", size=7, color=J_COLOURS[0])
    th, s, _, _ = poses[1]
    cx, cy = tr(placed[1].mean(0))
    c.text(cx + 0.05, cy, rf"$\theta$ = {np.rad2deg(th):.0f}°" + "\n" + f"$s$ = {s:g}", size=7,
           color=J_COLOURS[1])
    cx, cy = tr(placed[2].mean(0))
    c.text(cx, cy - 0.36, "dropped", size=7.5, color=J_COLOURS[2], weight="bold")
    c.text(ax0 + size / 2, 0.55, "some patterns are dropped (each with $p$ = 1/2):",
           size=8, color=INK)
    c.text(ax0 + size / 2, 0.35, "their points are absent", size=8, color=INK)
    # --- the union of the points: by object, and all grey
    s2, gap = 1.5, 0.3
    bx = [4.98, 4.98 + s2 + gap]
    lab = frame(bx[0], ymid - s2 / 2, s2, "union of the points", "coloured by object (labels)")
    see = frame(bx[1], ymid - s2 / 2, s2, "what the model sees", "7 points, shuffled, unlabelled")
    c.arrow((ax0 + size + 0.04, ymid), (bx[0] - 0.04, ymid), color=INK, lw=1.2)
    c.arrow((bx[0] + s2 + 0.03, ymid), (bx[1] - 0.03, ymid), color=INK, lw=1.0, ms=7)
    for k, x in enumerate(placed):
        if not poses[k][3]:
            continue
        c.ax.plot(*lab(x), ls="none", marker="o", ms=5, mfc=J_COLOURS[k], mec="white", mew=0.6, zorder=2)
        c.ax.plot(*see(x), ls="none", marker="o", ms=5, mfc="#6f6f6f", mec="white", mew=0.6, zorder=2)
    for i in range(2):
        c.text(bx[i] + 0.03, ymid - s2 / 2 - 0.1, "−1", size=6.5, color=grey, ha="left")
        c.text(bx[i] + s2 - 0.03, ymid - s2 / 2 - 0.1, "1", size=6.5, color=grey, ha="right")
    c.text((bx[0] + bx[1] + s2) / 2, 0.55, r"coordinates normalised to $[-1, 1]$;", size=8)
    c.text((bx[0] + bx[1] + s2) / 2, 0.35, "the dropped object's 4 slots: presence 0", size=8)
    return c


# ----------------------------------------------------------------------------------------------- 7. GMM
def gmm() -> Canvas:
    "The part capsules' Gaussian mixture (Chapter 7): votes, their scales and presences, and the points."
    W, H = 8.5, 4.1
    c = Canvas(W, H)
    grey = "#666666"
    # K = 3 capsules × N = 4 votes: centre, angle, size of the vote pattern, a_k, a_kn, λ_kn (in inches)
    caps = [((1.15, 2.4), np.deg2rad(15), 0.62, 0.95, [0.95, 0.9, 0.85, 0.95], [0.2, 0.24, 0.17, 0.22]),
            ((3.0, 2.3), np.deg2rad(-20), 0.68, 0.85, [0.9, 0.95, 0.8, 0.15], [0.24, 0.19, 0.22, 0.28]),
            ((2.1, 1.45), np.deg2rad(40), 0.36, 0.3, [0.6, 0.5, 0.7, 0.6], [0.2, 0.17, 0.19, 0.2])]
    unit = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], float) / np.sqrt(2)
    tri = np.array([[0, 1.0], [-0.87, -0.5], [0.87, -0.5], [1.1, 0.6]], float)
    shapes = [unit, tri, unit]
    rng = np.random.default_rng(3)
    c.ax.add_patch(FancyBboxPatch((0.2, 0.55), 4.0, 3.3, boxstyle="round,pad=0,rounding_size=0.07",
                                  fc="#fcfcfc", ec="#bbbbbb", lw=0.8, zorder=0))
    c.text(2.2, 3.62, r"$K$ = 3 capsules × $N$ = 4 votes, $M$ = 7 points", size=8.5, weight="bold")
    points = []
    for k, ((cx, cy), th, r, a_k, a_kn, lam) in enumerate(caps):
        R = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
        mu = shapes[k] * r @ R.T + (cx, cy)
        col = J_COLOURS[k]
        for m, a, l in zip(mu, a_kn, lam):
            w = a_k * a
            c.ax.add_patch(Circle(m, l, fc=col, ec="none", alpha=0.45 * w, zorder=1))
            c.ax.add_patch(Circle(m, l, fc="none", ec=col, lw=0.6, alpha=0.8 * w, zorder=1))
            c.ax.plot(*m, marker="x", ms=5, mew=1.3, color=col, alpha=max(0.25, w), zorder=2)
            if k < 2 and a > 0.5:
                points.append(m + rng.normal(0, 0.06, 2))
    pts = np.array(points)
    c.ax.plot(pts[:, 0], pts[:, 1], ls="none", marker="o", ms=4.2, color="black", zorder=4)
    # legend under the plot
    ly = 0.8
    c.ax.plot(0.45, ly, marker="o", ms=4.2, color="black")
    c.text(0.56, ly, "point $x_m$", size=7.5, ha="left")
    c.ax.add_patch(Circle((1.55, ly), 0.11, fc=J_COLOURS[0], alpha=0.4, ec="none"))
    c.ax.plot(1.55, ly, marker="x", ms=5, mew=1.3, color=J_COLOURS[0])
    c.text(1.72, ly, r"vote $\mu_{kn}$, radius $\lambda_{kn}$, opacity $\propto a_k a_{kn}$", size=7.5,
           ha="left")
    c.text(2.2, 0.3, "colour = capsule $k$; the faint green capsule has $a_3$ = 0.3", size=7.5, color=grey)
    # --- the formula
    fx = 6.35
    c.text(fx, 3.62, "the likelihood of the points (Eq. 7.2)", size=9.5, weight="bold")
    c.path_text(fx, 2.98, r"$\log p(x_{1:M}) = \sum_m\, \log \sum_{k,n} \pi_{kn}\,"
                r"\mathcal{N}(x_m \mid \mu_{kn}, \lambda_{kn}^2 I)$", size=10.5)
    c.text(fx, 2.22, r"$\pi_{kn} = \dfrac{a_k\,a_{kn}}{\sum_{k',n'}\, a_{k'}\,a_{k'n'}}$", size=10.5)
    c.text(fx, 1.62, "a point far from every disc is improbable", size=7.8, color=grey)
    mix = c.box(fx, 0.95, 3.9, 0.7, "computed in log space: log-sum-exp", "", "mix", title_size=9)
    mix.texts.append(c.text(fx, 0.83, r"$\log \sum_c e^{\ell_c} = \ell^* + \log \sum_c e^{\ell_c - \ell^*}$,"
                            r"   $\ell_c = \log\pi_c + \log p(x_m \mid c)$,  $\ell^* = \max_c \ell_c$", size=8,
                            check=False, zorder=3))
    mix.texts[0].set_y(1.13)
    return c


# ----------------------------------------------------------------------------------------------- 8. SCAE
def scae() -> Canvas:
    "The image Stacked Capsule Autoencoder (Chapters 10-11): the PCAE on the left, the OCAE on the right."
    W, H = 9.8, 6.8
    c = Canvas(W, H)
    lx, rx, bw, bh = 2.35, 7.45, 4.1, 0.56
    ys = [6.15 - 0.9 * k for k in range(7)]
    c.text(lx, 6.6, "Part Capsule Autoencoder (Chapter 10)", size=9.5, weight="bold")
    c.text(rx, 6.6, "Object Capsule Autoencoder (Chapter 11)", size=9.5, weight="bold")
    img = c.box(lx, ys[0], bw, bh, "image $y$", "a digit on a 40×40 canvas", "data")
    cnn = c.box(lx, ys[1], bw, bh, "CNN, 4 layers of 128 3×3 filters",
                "strides 2, 2, 1, 1: a 5×5 map, + a bias per position", "conv")
    att = c.box(lx, ys[2], bw, bh, "attention pooling per part (Eq. 10.1)",
                "a softmax over the 25 positions for each of $N$ = 40", "attn")
    prt = c.box(lx, ys[3], bw, bh, "$N$ part capsules",
                r"pose $x_n$ (affine), presence $\delta_n$, features $z_n$", "caps")
    tpl = c.box(lx, ys[4], bw, bh, "templates $T_n$ placed by $x_n$ (Eq. 10.4)",
                r"11×11, alpha logits, brightness $\gamma_n$ from $z_n$", "dec")
    mix = c.box(lx, ys[5], bw, bh, "a mixture at every pixel (Eq. 10.5)",
                r"weights $\propto \delta_n e^{\hat{A}_{n,i}}$, + a background", "mix")
    ll = c.box(lx, ys[6], bw, bh, r"$\log p(y)$ (maximised)", "summed over the 1,600 pixels", "loss")
    chain = [img, cnn, att, prt, tpl, mix, ll]
    labels = ["[B,1,40,40]", "[B,128,5,5]", "[B,N,6+16+1]", "", "[B,N+1,40,40]", ""]
    for a, b, s in zip(chain, chain[1:], labels):
        c.arrow(a.bottom(), b.top())
        if s:
            c.shape(lx + 0.1, (a.b + b.t) / 2, s)
    st = c.box(rx, ys[2], bw, bh, "the parts as a set",
               r"$[x_n,\ 1-\delta_n,\ z_n,\ \gamma_n T_n]$: gradient stopped but for $z_n$", "data")
    enc = c.box(rx, ys[3], bw, bh, "Set Transformer (Eq. 11.1)",
                "3 blocks with presences, then $K$ = 32 learned queries", "attn")
    obj = c.box(rx, ys[4], bw, bh, "$K$ object capsules, their votes",
                r"$v_{kn} = OV_k\,OP_{kn}$, scale $\lambda_{kn}$, weight $a_k a_{kn}$", "caps")
    pll = c.box(rx, ys[5], bw, bh, r"$\log p(x_{1:N})$ (Eq. 11.2), sparsity",
                "each part's pose under its $K$ votes, weighted by $d_n$", "loss")
    use = c.box(rx, ys[6], bw, bh, r"presences $\hat{a}_k = a_k \max_n a_{kn}$",
                "K-means on them: the digit, unsupervised", "plain")
    for a, b in zip([st, enc, obj, pll], [enc, obj, pll, use]):
        c.arrow(a.bottom(), b.top())
    c.shape(rx + 0.1, (st.b + enc.t) / 2, "[B,N,144]")
    c.shape(rx + 0.1, (enc.b + obj.t) / 2, "[B,K,256]")
    # parts -> set; part poses are the OCAE's targets
    gx = lx + bw / 2 + 0.25
    c.arrow(prt.right(0.1), (gx, prt.cy + 0.1), (gx, st.cy), st.left())
    c.arrow(prt.right(-0.1), (gx + 0.3, prt.cy - 0.1), (gx + 0.3, pll.cy), pll.left(), ls="--")
    c.text(gx + 0.42, (prt.cy + obj.cy) / 2 - 0.35, "targets", size=7.5, rotation=90, ha="left",
           color="#555555")
    return c


FALLBACK = {                         # what a browser without DejaVu uses instead (Verdana has its metrics)
    "'DejaVu Sans Mono'": "'DejaVu Sans Mono', Menlo, Consolas, monospace",
    "'DejaVu Sans Display'": "'DejaVu Sans Display', 'DejaVu Sans', Verdana, sans-serif",
    "'DejaVu Sans'": "'DejaVu Sans', Verdana, sans-serif",
}
_TSPAN = re.compile(r'<tspan x="([^"]+)" y="([^"]+)" style="([^"]+)">([^<]*)</tspan>')


def _merge_tspans(block: re.Match) -> str:
    "One <text> of mathtext, a <tspan> per glyph, as few <tspan>s with a list of x positions."
    runs: list[list] = []
    for x, y, style, ch in _TSPAN.findall(block.group(1)):
        glyph = html.unescape(ch)
        if len(glyph) == 1 and runs and runs[-1][1] == y and runs[-1][2] == style:
            runs[-1][0].append(x)
            runs[-1][3] += ch
        else:
            runs.append([[x], y, style, ch])
            if len(glyph) != 1:                    # several characters: let them flow, start a new run after
                runs.append([[], None, None, ""])
    out = "".join(f'<tspan x="{" ".join(xs)}" y="{y}" style="{st}">{t}</tspan>' for xs, y, st, t in runs if xs)
    return f'<text xml:space="preserve">{out}</text>'


def tidy_svg(svg: str) -> str:
    "Smaller, portable SVG: comments out, glyph runs merged, short numbers, font fallbacks."
    svg = re.sub(r"\s*<!--.*?-->", "", svg, flags=re.S)
    svg = re.sub(r"<text>\s*((?:<tspan[^>]*>[^<]*</tspan>\s*)+)</text>", _merge_tspans, svg)
    svg = re.sub(r' transform="rotate\(-0 [^)]*\)"', "", svg)
    svg = re.sub(r'( (?:x|y|d|transform)=")([^"]*)"',             # numbers in geometry only, not in labels
                 lambda m: m.group(1) + re.sub(r"(\d\.\d\d)\d+", r"\1", m.group(2)) + '"', svg)
    for family, fallback in FALLBACK.items():
        svg = svg.replace(f"font-family: {family}", f"font-family: {fallback}")
    styles = re.findall(r' style="([^"]+)"', svg)
    counts: dict[str, int] = {}
    for st in styles:
        counts[st] = counts.get(st, 0) + 1
    names = {st: f"s{i}" for i, st in enumerate(sorted(st for st, n in counts.items() if n > 1))}
    svg = re.sub(r' style="([^"]+)"', lambda m: f' class="{names[m.group(1)]}"' if m.group(1) in names
                 else m.group(0), svg)
    css = "".join(f"\n  .{name}{{{st}}}" for st, name in names.items())
    head = "stroke-linecap: butt}</style>"
    if head not in svg:
        raise ValueError("unexpected SVG header from matplotlib; update tidy_svg")
    svg = svg.replace(head, "stroke-linecap: butt}" + css + "\n  </style>", 1)
    private = sorted({ch for ch in svg if "\ue000" <= ch <= "\uf8ff"})
    if private:
        raise ValueError(f"private-use glyphs {private!r} would not render in a browser; avoid their symbols")
    return svg


def save_svg(c: Canvas, path: Path) -> None:
    "Write `c` as tidy SVG, byte-identical on every run."
    for artist in c.ax.get_children():
        artist.set_clip_on(False)
    buf = io.StringIO()
    c.fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    path.write_text(tidy_svg(buf.getvalue()), encoding="utf-8")


FIGURES: dict[str, Callable[[], Canvas]] = {
    "capsnet": capsnet,
    "routing": routing,
    "set_transformer": set_transformer,
    "ccae": ccae,
    "squash": squash,
    "constellations": constellations,
    "gmm": gmm,
    "scae": scae,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the SVGs (default nbs/images)")
    ap.add_argument("--png", type=Path, default=None, help="also write PNG previews into this folder")
    ap.add_argument("--only", nargs="*", default=None, help="draw only these figures")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    problems = []
    with matplotlib.rc_context(RC):
        for name, draw in FIGURES.items():
            if args.only and name not in args.only:
                continue
            c = draw()
            problems += c.check(name)
            path = args.out / f"{name}.svg"
            save_svg(c, path)
            print(f"wrote {path} ({path.stat().st_size / 1024:.1f} KiB)")
            if args.png is not None:
                args.png.mkdir(parents=True, exist_ok=True)
                c.fig.savefig(args.png / f"{name}.png", dpi=110)
    for p in problems:
        print("layout:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
