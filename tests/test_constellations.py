"""The constellation data of Chapter 6, checked on the installed package."""
import math

import pytest
import torch

from capsule_book.constellations import (PATTERNS, Constellations, make_constellations, object_points,
                                         plot_constellations, similarity_transform)

# The points are computed in float64 and rounded once to float32, in [-1, 1]: each coordinate is off by at most
# half a float32 spacing at 1, ε/2. A distance d between two points is then off by at most √2·ε, a ratio of two
# distances d / d_max ≤ 1 by 2√2·ε / d_max, an angle by √2·ε / d. The tolerances below are these bounds (c = 4 ≥ 2√2).
EPS32 = torch.finfo(torch.float32).eps


def _batch(n=4000, seed=0, **kw):
    return make_constellations(n, generator=torch.Generator().manual_seed(seed), **kw)


def _sorted_distances(x):
    i, j = torch.triu_indices(x.shape[-2], x.shape[-2], 1)
    return torch.cdist(x, x)[..., i, j].sort(-1).values


@pytest.mark.parametrize("patterns", [("square", "triangle", "square"), ("pentagon", "L"), ("triangle",)])
def test_counts_per_object(patterns):
    b = _batch(500, patterns=patterns)
    sizes = torch.tensor([len(PATTERNS[p]) for p in patterns])
    assert b.points.shape == (500, int(sizes.sum()), 2)
    counts = torch.stack([(b.pattern_id == k).sum(1) for k in range(len(patterns))], 1)
    assert (counts == sizes).all()


def test_official_templates():
    # sm = 1 in the official code: the square's corners span [1, 3]², the pentagon reaches y = -1.
    assert PATTERNS["square"].tolist() == [[3, 3], [1, 1], [3, 1], [1, 3]]
    assert PATTERNS["triangle"].tolist() == [[1, 2], [3, 1], [3, 3]]
    assert PATTERNS["pentagon"].tolist() == [[1, 1], [2, -1], [3, 0], [3, 2], [2, 3]]
    assert PATTERNS["L"].tolist() == [[1, 1], [2, 1], [3, 1], [3, 2], [3, 3]]


@pytest.mark.parametrize("drop_prob", [0.0, 0.2, 0.5, 1.0])
def test_whole_objects_dropped_at_rate(drop_prob):
    B, K = 4000, 3
    b = _batch(B, drop_prob=drop_prob)
    any_k = torch.stack([(b.presence & (b.pattern_id == k)).any(1) for k in range(K)], 1)
    all_k = torch.stack([(b.presence | (b.pattern_id != k)).all(1) for k in range(K)], 1)
    assert torch.equal(any_k, all_k)  # all or nothing within an object
    kept = any_k.double().mean().item()
    sd = math.sqrt(drop_prob * (1 - drop_prob) / (B * K))
    assert abs(kept - (1 - drop_prob)) <= 5 * sd + 1e-12
    empty = (~b.presence.any(1)).double().mean().item()  # examples with nothing present: drop_prob**K
    p = drop_prob ** K
    assert abs(empty - p) <= 5 * math.sqrt(p * (1 - p) / B) + 1e-12


def test_objects_dropped_independently():
    b = _batch(8000)
    any_k = torch.stack([(b.presence & (b.pattern_id == k)).any(1) for k in range(3)], 1).double()
    corr = torch.corrcoef(any_k.T)
    assert (corr - torch.eye(3)).abs().max() < 5 / math.sqrt(8000)


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_coordinates_fill_minus_one_one(noise):
    b = _batch(300, gaussian_noise=noise)
    assert b.points.min().item() == -1.0
    assert 1 - EPS32 <= b.points.max().item() <= 1.0                 # one rounding, and the 1e-8 of the normalisation


def test_single_example_also_normalised():
    b = _batch(1)
    assert b.points.min().item() == -1.0 and b.points.max().item() >= 1 - EPS32


@pytest.mark.parametrize("patterns", [("square", "triangle", "square"), ("pentagon", "L")])
def test_shapes_preserved_up_to_similarity(patterns):
    b = _batch(1000, patterns=patterns)
    for k, name in enumerate(patterns):
        d = _sorted_distances(object_points(b, k).double())
        d0 = _sorted_distances(PATTERNS[name])
        assert ((d / d[:, -1:] - d0 / d0[-1]).abs() <= 4 * EPS32 / d[:, -1:]).all()


def test_noise_breaks_rigidity():
    b = _batch(200, gaussian_noise=0.3)
    d = _sorted_distances(object_points(b, 0).double())
    d0 = _sorted_distances(PATTERNS["square"])
    assert ((d / d[:, -1:]) - d0 / d0[-1]).abs().max() > 1e-2


def test_scale_range():
    for max_scale, ratio in [(3.0, 4.0), (1.0, 2.0)]:
        b = _batch(4000, max_scale=max_scale)
        s = torch.cat([_sorted_distances(object_points(b, k).double())[:, -1]
                       / _sorted_distances(PATTERNS[name])[-1] for k, name in enumerate(("square", "triangle", "square"))])
        r = (s.max() / s.min()).item()
        assert 0.97 * ratio < r < ratio
    b = _batch(100, max_scale=0.0)
    s = torch.cat([_sorted_distances(object_points(b, k).double())[:, -1] for k in (0, 2)])  # the two squares
    assert ((s / s[0] - 1).abs() <= 4 * EPS32 / s.min()).all()


def _square_angle(b):
    v = (b.points[:, 0] - b.points[:, 1]).double()  # corner (3,3) minus (1,1): 45 degrees in the template
    return torch.remainder(torch.atan2(v[:, 1], v[:, 0]) - math.pi / 4 + math.pi, 2 * math.pi) - math.pi


@pytest.mark.parametrize("rotation_percent", [0.5, 0.25, 0.0])
def test_rotation_uniform_in_range(rotation_percent):
    b = _batch(20000, shuffle=False, rotation_percent=rotation_percent)
    theta = _square_angle(b)
    half = math.pi * rotation_percent
    diagonal = (b.points[:, 0] - b.points[:, 1]).double().norm(dim=-1)  # the side the angle is measured on
    assert (theta.abs() <= half + 4 * EPS32 / diagonal).all()
    if rotation_percent > 0:
        q = torch.quantile(theta, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64))
        expected = torch.tensor([-0.8, -0.5, 0.0, 0.5, 0.8], dtype=torch.float64) * half
        torch.testing.assert_close(q, expected, atol=0.03 * half + 1e-3, rtol=0)


def test_shuffle_is_per_example_and_keeps_labels_with_points():
    b = _batch(500)
    assert (b.pattern_id != b.pattern_id[:1]).any(1).float().mean() > 0.99
    assert all(sorted(row) == [0] * 4 + [1] * 3 + [2] * 4 for row in b.pattern_id.tolist())
    unshuffled = _batch(500, shuffle=False)
    assert (unshuffled.pattern_id == torch.tensor([0] * 4 + [1] * 3 + [2] * 4)).all()


def test_similarity_transform_eq_6_1():
    p = PATTERNS["triangle"]
    theta, s, t = torch.tensor([0.3], dtype=torch.float64), torch.tensor([2.5], dtype=torch.float64), \
        torch.tensor([[4.0, -1.0]], dtype=torch.float64)
    R = torch.tensor([[math.cos(0.3), -math.sin(0.3)], [math.sin(0.3), math.cos(0.3)]], dtype=torch.float64)
    torch.testing.assert_close(similarity_transform(p, theta, s, t)[0], 2.5 * p @ R.T + t / 2.5)


def test_reproducible_with_generator():
    a, b, c = _batch(16, seed=7), _batch(16, seed=7), _batch(16, seed=8)
    assert isinstance(a, Constellations)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a.points, c.points)


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(batch_size=4, patterns=("circle",)),
                                 dict(batch_size=4, drop_prob=1.5), dict(batch_size=4, patterns=())])
def test_bad_arguments_refused(bad):
    with pytest.raises(ValueError):
        make_constellations(**bad)


def test_figure_colours_by_labels():
    import matplotlib
    matplotlib.use("Agg")
    b = _batch(4, drop_prob=0.0)
    fig = plot_constellations(b, n_examples=4, ncols=2)
    ax = fig.axes[0]
    filled = [c for c in ax.collections if len(c.get_offsets()) and c.get_facecolors().shape[0]]
    assert sum(len(c.get_offsets()) for c in filled) == 11  # every present point drawn once
    assert len({tuple(c.get_facecolors()[0]) for c in filled}) == 3  # one colour per object
