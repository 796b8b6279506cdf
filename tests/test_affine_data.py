"""The expanded MNIST (digits at uniform offsets on a 40x40 canvas) and the affNIST-style test set of Appendix B
(Eq. B.2): the transformations' ranges hold on 10,000 draws, every digit keeps its label and all its ink, the
recorded parameters are the ones applied, and the geometry's directions are right. Uses the MNIST sample shipped
with the package."""
import math

import pytest
import torch
import torch.nn.functional as F

from capsule_book.data import (AffineRanges, CanvasBatches, affine_draws, affine_matrix, affine_test_set, ink_box,
                               load_mnist, warp)


@pytest.fixture(scope="module")
def digits():
    return load_mnist(train=False, sample=True)


@pytest.fixture(scope="module")
def affine(digits):
    return affine_test_set(*digits, seed=0)


def test_ranges_hold_and_are_filled_on_10000_draws():
    theta, tau, scale, where = affine_draws(10_000, torch.Generator().manual_seed(1))
    for v, lo, hi in ((theta, -20, 20), (tau, -0.2, 0.2), (scale, 0.8, 1.2), (where, 0, 1)):
        assert v.min() >= lo and v.max() <= hi
        width = hi - lo
        assert v.min() < lo + 0.01 * width and v.max() > hi - 0.01 * width
        # uniform: a quarter of the draws in each quarter of the range, to 3 points
        counts = torch.histc(v.float().flatten(), bins=4, min=lo, max=hi) / v.numel()
        assert (counts - 0.25).abs().max() < 0.03, counts
    narrow = affine_draws(1000, torch.Generator().manual_seed(1), AffineRanges(rotation=5, shear=0, scale=(1, 1)))
    assert narrow[0].abs().max() <= 5 and narrow[1].abs().max() == 0 and (narrow[2] == 1).all()


def test_labels_unchanged_and_every_digit_keeps_all_its_ink(digits, affine):
    x, y = digits
    assert torch.equal(affine.labels, y) and affine.images.shape == (len(y), 1, 40, 40)
    assert 0 <= affine.images.min() and affine.images.max() <= 1
    # an area-scaling map multiplies the ink by det A = s_x s_y; a digit cut by the canvas's edge would lose more
    ratio = affine.images.sum((1, 2, 3)) / (x.float().sum((1, 2)) / 255) / affine.scale.prod(1)
    assert (ratio - 1).abs().max() < 0.06, (ratio.min(), ratio.max())
    box = ink_box(affine.images)
    assert (box >= 0).all() and (box <= 39).all()
    # the shifts spread the digits over the canvas: some touch each edge
    assert (box[:, 0] == 0).any() and (box[:, 1] == 39).any() and (box[:, 2] == 0).any() and (box[:, 3] == 39).any()


def test_the_recorded_parameters_are_the_ones_applied(digits, affine):
    x, _ = digits
    A = affine_matrix(affine.rotation, affine.shear, affine.scale[:, 0], affine.scale[:, 1])
    A_inv = torch.linalg.inv(A)
    back = warp(affine.images, A_inv, -(A_inv @ affine.shift[..., None].double())[..., 0])
    centred = F.pad(x[:, None].float() / 255, (6, 6, 6, 6))
    cos = F.cosine_similarity(back.flatten(1), centred.flatten(1))
    assert cos.min() > 0.9 and cos.mean() > 0.97, (cos.min(), cos.mean())
    # the same seed gives the same set, another seed another
    again = affine_test_set(x[:50], digits[1][:50], seed=0)
    assert torch.equal(again.images, affine.images[:50])
    assert not torch.equal(affine_test_set(x[:50], digits[1][:50], seed=1).images, again.images)


def test_directions_rotation_shear_scale_and_shift():
    bar = torch.zeros(1, 1, 40, 40)
    bar[0, 0, 20, 10:30] = 1                                      # a horizontal bar, columns 10..29, row 20
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    turned = warp(bar, affine_matrix(90 * one, zero, one, one), torch.zeros(1, 2, dtype=torch.float64))
    x0, x1, y0, y1 = ink_box((turned > 0.5).float())[0].tolist()
    assert x0 == x1 and y1 - y0 == 19                             # now vertical, as long
    wide = warp(bar, affine_matrix(zero, zero, 1.5 * one, one), torch.zeros(1, 2, dtype=torch.float64))
    x0, x1, y0, y1 = ink_box((wide > 0.5).float())[0].tolist()
    assert y0 == y1 == 20 and 28 <= x1 - x0 + 1 <= 31             # s_x stretches x only: 20 -> 30 columns
    moved = warp(bar, affine_matrix(zero, zero, one, one), torch.tensor([[3.0, -2.0]], dtype=torch.float64))
    assert torch.allclose(moved[0, 0, 18, 13:33], torch.ones(20), atol=1e-5) and moved.sum().item() == pytest.approx(20)
    # shear τ moves a point by τ·y along x: the bar's row is the centre's, so a vertical bar leans instead
    vbar = bar.transpose(-1, -2)
    leaned = warp(vbar, affine_matrix(zero, 0.2 * one, one, one), torch.zeros(1, 2, dtype=torch.float64))
    x0, x1, _, _ = ink_box((leaned > 0.3).float())[0].tolist()
    assert x1 - x0 >= 3                                           # 20 rows × 0.2 = 4 columns of lean


def test_expanded_mnist_offsets_are_uniform_and_repeatable(digits):
    x, y = digits
    cb = CanvasBatches(x, y, batch_size=len(x), uniform=True, seed=1)
    xb, yb = next(iter(cb))
    offsets = (ink_box(xb) - ink_box(x[cb.indices(), None].float()))[:, [0, 2]]
    assert offsets.min() >= 0 and offsets.max() <= 12
    freq = torch.bincount(offsets.flatten(), minlength=13) / offsets.numel()
    assert (freq - 1 / 13).abs().max() < 0.03, freq
    assert torch.equal(yb, y[cb.indices()])
    assert torch.allclose(xb.sum((1, 2, 3)), x[cb.indices()].float().sum((1, 2)) / 255)
    assert torch.equal(next(iter(cb))[0], xb)                     # the same epoch, the same placements


def test_bad_inputs_name_what_was_expected(digits):
    x, y = digits
    with pytest.raises(ValueError, match=r"expected images \[B, 1, H, W\], A \[B, 2, 2\] and t \[B, 2\]"):
        warp(torch.zeros(2, 1, 40, 40), torch.eye(2).expand(3, 2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"expected digits \[N, h, w\] and labels \[N\]"):
        affine_test_set(x[:10], y[:9])


def test_capsnet_on_the_40x40_canvas_keeps_the_contract():
    from capsule_book.capsnet import CAPSNET_RUN_KEYS, TrainConfig, capsnet_from_config
    from dataclasses import asdict
    torch.manual_seed(0)
    config = {k: v for k, v in asdict(TrainConfig(canvas=40)).items() if k in CAPSNET_RUN_KEYS}
    net = capsnet_from_config(config).eval()
    assert net.digit_caps.in_caps == 32 * 12 * 12                 # (40 - 8 - 9) // 2 + 1 = 12 positions a side
    x = torch.rand(3, 1, 40, 40)
    with torch.no_grad():
        out = net(x)
        caps, c = net.capsules(x, return_coupling=True)
    assert out.caps.shape == (3, 10, 16) and (out.caps.norm(dim=-1) < 1).all()
    assert out.reconstructions.shape == (3, 1, 40, 40) and torch.equal(out.caps, caps)
    assert torch.allclose(c.sum(-1), torch.ones(3, 4608), atol=1e-5)   # couplings sum to one over the digits
    with pytest.raises(ValueError, match=r"CapsNet expects images of shape \[B,1,40,40\], got \[3, 1, 28, 28\]"):
        net(torch.rand(3, 1, 28, 28))
    # a run's configuration without `canvas` (every run before it existed) is the 28x28 network
    old = {k: v for k, v in config.items() if k != "canvas"}
    assert capsnet_from_config(old).image_size == 28


def test_train_cnn_command_runs_resumes_and_its_weights_build(tmp_path, capsys):
    import json
    from capsule_book.cli import main
    from capsule_book.train import load_checkpoint
    from capsule_book.weights import BUILDERS
    out = tmp_path / "cnn"
    tiny = ["--sample", "--batch-size", "8", "--limit-test", "16", "--no-progress", "--device", "cpu",
            "--out", str(out), "--log-every", "1"]
    assert main(["train", "cnn", "--steps", "2"] + tiny) == 0
    assert main(["train", "cnn", "--steps", "3", "--resume"] + tiny) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    ck = load_checkpoint(out / "last.pt")
    assert ck["task"] == "cnn" and ck["step"] == 3 and ck["config"]["canvas"] == 40
    net = BUILDERS["cnn"](ck["config"])
    net.load_state_dict(ck["model"])
    net.eval()
    x = torch.rand(2, 1, 40, 40)
    assert net(x).shape == (2, 10) and torch.isfinite(net(x)).all()
    with pytest.raises(SystemExit) as e:
        main(["train", "cnn", "--dropout", "1"] + tiny)
    assert e.value.code == 2 and "--dropout: must be a number in [0, 1), got 1" in capsys.readouterr().err


def test_eval_commands_report_the_expanded_and_affine_accuracies(tmp_path, capsys):
    import json
    from capsule_book.cli import main
    from capsule_book.robustness import load_cnn, predict
    from capsule_book.data import load_mnist
    out = tmp_path / "cnn"
    assert main(["train", "cnn", "--steps", "1", "--sample", "--batch-size", "8", "--limit-test", "8", "--no-progress",
                 "--device", "cpu", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", "cnn", "--checkpoint", str(out / "last.pt"), "--sample", "--limit-test", "40"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, _ = load_cnn(out / "last.pt")
    aff = affine_test_set(*load_mnist(False, sample=True, limit=40), seed=0)
    assert report["n"] == 40 and report["affine_accuracy"] == pytest.approx(
        (predict(model, aff.images) == aff.labels).double().mean().item())
    assert 0 <= report["expanded_accuracy"] <= 1
    # a CNN checkpoint is not a CapsNet's, and the other way round: one line, exit 2
    with pytest.raises(SystemExit) as e:
        main(["eval", "capsnet", "--checkpoint", str(out / "last.pt"), "--sample"])
    assert e.value.code == 2 and "holds a cnn checkpoint, not a CapsNet one" in capsys.readouterr().err


def test_a_run_ends_finished_at_its_target_accuracy(tmp_path, capsys):
    import json
    from capsule_book.cli import main
    from capsule_book.train import load_checkpoint
    out = tmp_path / "cnn"
    tiny = ["--sample", "--batch-size", "8", "--limit-test", "8", "--no-progress", "--device", "cpu",
            "--out", str(out), "--steps", "10", "--eval-every", "2", "--stop-at-accuracy", "0"]
    assert main(["train", "cnn"] + tiny) == 0
    assert "finished at step 2: the evaluation reached the run's target" in capsys.readouterr().out
    assert load_checkpoint(out / "last.pt")["step"] == 2
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2 and "eval_accuracy" in rows[-1]
    # resumed, it has nothing left to do; an unreachable target trains to the end
    assert main(["train", "cnn", "--resume"] + tiny) == 0
    assert load_checkpoint(out / "last.pt")["step"] == 2
    assert main(["train", "cnn", "--resume"] + tiny[:-1] + ["1"]) == 0
    assert load_checkpoint(out / "last.pt")["step"] == 10


def test_the_cnn_cools_down_from_its_run_as_capsnet_does(tmp_path, capsys):
    "Chapter 4's Eq. (4.2) for the CNN: η from the run's last Eq. (4.1) value down to 0, its data going on."
    import json
    from capsule_book.cli import main
    from capsule_book.train import load_checkpoint
    run, cool = tmp_path / "run", tmp_path / "cool"
    tiny = ["--sample", "--batch-size", "8", "--limit-train", "32", "--limit-test", "8", "--no-progress",
            "--device", "cpu", "--log-every", "1"]
    assert main(["train", "cnn", "--steps", "3", "--out", str(run)] + tiny) == 0
    assert main(["train", "cnn", "--steps", "4", "--out", str(cool), "--cooldown-from", str(run / "last.pt")]
                + tiny) == 0
    rows = [json.loads(l) for l in (cool / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    eta0 = 1e-3 * 0.96 ** (3 / 2000)
    assert [r["lr"] for r in rows] == pytest.approx([eta0 * (1 - s / 4) for s in range(4)], rel=1e-12)
    assert [r["epoch"] for r in rows] == [1.0, 1.25, 1.5, 1.75]       # 4 batches an epoch: steps 4 to 7
    ck, base = load_checkpoint(cool / "last.pt"), load_checkpoint(run / "last.pt")
    assert (ck["config"]["cooldown_from_step"], ck["config"]["cooldown_steps"]) == (3, 4)
    first = next(iter(base["model"]))                                 # the cooldown trained on from the run
    assert not torch.equal(ck["model"][first], base["model"][first])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:                             # other settings are refused by name
        main(["train", "cnn", "--steps", "4", "--out", str(tmp_path / "x"), "--lr", "0.01",
              "--cooldown-from", str(run / "last.pt")] + tiny)
    assert e.value.code == 2 and "was trained with lr=0.001; this run asks for lr=0.01" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                             # and a cooldown's own checkpoint
        main(["train", "cnn", "--steps", "4", "--out", str(tmp_path / "y"),
              "--cooldown-from", str(cool / "last.pt")] + tiny)
    assert e.value.code == 2 and "is a cooldown's checkpoint" in capsys.readouterr().err
    other = tmp_path / "other.pt"                                     # and another task's, named as a CNN's
    torch.save({**base, "task": "capsnet"}, other)
    with pytest.raises(SystemExit) as e:
        main(["train", "cnn", "--steps", "4", "--out", str(tmp_path / "z"), "--cooldown-from", str(other)] + tiny)
    assert e.value.code == 2 and "holds a capsnet checkpoint, not a CNN one" in capsys.readouterr().err
