"""The image Stacked Capsule Autoencoder (Chapters 10-11): canvas data, templates, the image and part
likelihoods, the set encoder's presence masks, gradients, evaluation, the engine and the command line.
Tiny models on the shipped MNIST sample; nothing is downloaded."""
import json
import math

import numpy as np
import pytest
import torch

from capsule_book.data import CanvasBatches, canvas_offsets, load_mnist, place_on_canvas
from capsule_book.gmm import gmm_log_likelihood
from capsule_book.pcae import image_log_likelihood, official_template_init, transform_templates
from capsule_book.ccae import geometric_transform
from capsule_book.scae import (SCAE, SCAEConfig, kmeans_accuracy, load_scae, part_pose_likelihood,
                               presence_attention, train_scae)
from capsule_book.set_transformer import Multihead, attention

SMALL = dict(n_parts=5, n_objects=4, n_object_params=8, n_hidden=16, set_out=16, set_dim=8)


def test_canvas_offsets_follow_the_official_pad_and_shift():
    room = 12
    # every draw s in [-12, 12] once: offset 0 once, every other offset twice (Eq. B.1)
    off = canvas_offsets(torch.arange(-room, room + 1), room)
    assert torch.bincount(off).tolist() == [1] + [2] * room
    # by hand: s = -5 pads 5 rows above, then ceil(7/2) = 4 of the 7 left; s = 3: ceil(9/2) = 5
    assert canvas_offsets(torch.tensor([-5, 3, 0, 12, -12]), room).tolist() == [9, 5, 6, 0, 12]
    with pytest.raises(ValueError, match=r"\[-12, 12\]"):
        canvas_offsets(torch.tensor([13]), room)


def test_digits_stay_whole_on_the_canvas_and_batches_resume():
    x, y = load_mnist(False, sample=True)
    b = CanvasBatches(x[:40], y[:40], batch_size=16, shuffle=True, seed=4)
    batches = list(b)
    assert all(imgs.shape[1:] == (1, 40, 40) for imgs, _ in batches)
    imgs, labels = batches[0]
    order = b.indices()[:16]
    assert torch.equal(labels, y[order])
    # all the ink is on the canvas, none added
    assert torch.allclose(imgs.sum((1, 2, 3)), x[order].float().sum((1, 2)) / 255)
    # the same batches again from batch 1 (offsets of skipped batches still drawn)
    assert all(torch.equal(a[0], c[0]) for a, c in zip(batches[1:], b.iter_from(1)))
    with pytest.raises(ValueError, match="inside the 40x40 canvas"):
        place_on_canvas(x[:1], torch.tensor([[13, 0]]))


def test_template_lands_where_its_pose_puts_it():
    one = torch.zeros(1, 1, 11, 11)
    one[0, 0, 7, 3] = 1.0
    torch.manual_seed(0)
    for _ in range(5):
        pose = geometric_transform(torch.randn(1, 1, 6) * 0.5, similarity=False)
        placed = transform_templates(one, pose, 40)[0, 0, 0]
        u = torch.tensor([-1 + 2 * 3 / 10, -1 + 2 * 7 / 10])
        col, row = ((pose[0, 0, :2, :2] @ u + pose[0, 0, :2, 2] + 1) / 2 * 39).tolist()
        if not (1 < row < 38 and 1 < col < 38):
            continue
        rr, cc = torch.meshgrid(torch.arange(40.), torch.arange(40.), indexing="ij")
        centre = ((placed * rr).sum() / placed.sum()).item(), ((placed * cc).sum() / placed.sum()).item()
        assert abs(centre[0] - row) < 0.15 and abs(centre[1] - col) < 0.15
    corners = transform_templates(torch.arange(121.).view(1, 1, 11, 11), torch.eye(3)[None, None], 40)
    assert corners[0, 0, 0, 0, 0] == 0 and corners[0, 0, 0, 0, -1] == 10 and corners[0, 0, 0, -1, 0] == 110


def test_template_init_is_the_official_rescaled_orthogonal_rows():
    t = official_template_init(40, 11, torch.Generator().manual_seed(1))
    assert t.shape == (40, 1, 11, 11) and t.min() == 0 and t.max() == 1
    rows = t.view(40, -1).double()
    # an affine image of orthonormal rows: centred rows keep distinct directions (full rank)
    assert torch.linalg.matrix_rank(rows - rows.mean(1, keepdim=True)) >= 39


def test_fast_pixel_mixture_is_eq_10_5_with_its_gradient():
    from capsule_book.pcae import pixel_mixture_log_likelihood
    torch.manual_seed(8)
    y = torch.rand(2, 1, 4, 4, dtype=torch.float64)
    args = (torch.rand(2, 3, 4, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True),
            torch.rand(1, dtype=torch.float64, requires_grad=True),
            torch.randn(1, dtype=torch.float64, requires_grad=True))
    full = lambda t, b: torch.cat([t, b.expand(2, 1, 4, 4)], 1)
    torch.testing.assert_close(pixel_mixture_log_likelihood(y, *args, sigma=0.5),
                               image_log_likelihood(y, full(args[0], args[2]), full(args[1], args[3]), 0.5))
    assert torch.autograd.gradcheck(lambda *t: pixel_mixture_log_likelihood(y, *t, sigma=0.5), args)


def test_canvas_grid_is_affine_grid():
    import torch.nn.functional as F
    from capsule_book.pcae import affine_inverse, canvas_grid
    poses = geometric_transform(torch.randn(3, 7, 6), similarity=False)
    ref = F.affine_grid(affine_inverse(poses).view(21, 2, 3), [21, 1, 40, 40], align_corners=True)
    torch.testing.assert_close(canvas_grid(poses, 40).view(21, 40, 40, 2), ref, atol=1e-5, rtol=1e-5)


def test_image_likelihood_is_the_literal_mixture_and_integrates_to_one():
    torch.manual_seed(3)
    means = torch.rand(2, 4, 3, 3, dtype=torch.float64)
    logits = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    y = torch.rand(2, 1, 3, 3, dtype=torch.float64)
    pi = logits.softmax(1)
    literal = torch.log((pi * torch.exp(-(y - means) ** 2 / 2) / math.sqrt(2 * math.pi)).sum(1)).sum((1, 2))
    assert torch.allclose(image_log_likelihood(y, means, logits), literal)
    ys = torch.linspace(-12, 13, 2001, dtype=torch.float64)
    dens = torch.stack([image_log_likelihood(v.view(1, 1, 1, 1), means[:1, :, :1, :1],
                                             logits[:1, :, :1, :1]).exp()[0] for v in ys])
    assert abs(torch.trapezoid(dens, ys).item() - 1) < 1e-7
    with pytest.raises(ValueError, match="expected image"):
        image_log_likelihood(y, means[:, :, :2], logits)


def test_presence_masks():
    torch.manual_seed(0)
    mh = Multihead(6, 6, 6, 2)
    X = torch.randn(3, 4, 6)
    Qh, Kh, Vh = mh.heads(X, X, X)
    d01 = torch.tensor([[1., 1, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]])
    boolean = mh.W_O(attention(Qh, Kh, Vh, d01.bool()[:, None]).transpose(1, 2).flatten(-2))
    for kind in ("official", "log"):
        torch.testing.assert_close(presence_attention(mh, X, X, d01, kind), boolean, atol=1e-5, rtol=1e-5)
    # fractional presences: official = the most present key alone; log = weights ∝ d e^s
    d = torch.tensor([[0.2, 0.95, 0.5, 0.9]]).expand(3, 4)
    hard = mh.W_O(Vh[:, :, 1:2].expand(-1, -1, 4, -1).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(presence_attention(mh, X, X, d, "official"), hard, atol=1e-5, rtol=1e-5)
    s = Qh @ Kh.mT / math.sqrt(3)
    w = s.exp() * d[:, None, None]
    soft = mh.W_O(((w / w.sum(-1, keepdim=True)) @ Vh).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(presence_attention(mh, X, X, d, "log"), soft, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="presence_mask"):
        presence_attention(mh, X, X, d, "hard")


def test_readout_keys_and_values_in_one_map_are_the_two_maps():
    "Eq. (11.1a): PartSetEncoder.composed gives the two-map output and gradients, under both masks."
    from capsule_book.scae import PartSetEncoder
    torch.manual_seed(0)
    parts, pres = torch.randn(3, 7, 20), torch.rand(3, 7)
    pres[0, :2] = 1.0                                            # fully present parts for the hard mask
    for mask in ("official", "log"):
        enc = PartSetEncoder(20, n_objects=6, dim=16, n_heads=2, dim_out=32, mask=mask)
        w = torch.randn(3, 6, 32)
        def run(composed):
            enc.composed = composed
            enc.zero_grad()
            out = enc(parts, pres)
            (out * w).sum().backward()
            return out.detach(), {n: p.grad.clone() for n, p in enc.named_parameters()}
        (one, g_one), (two, g_two) = run(True), run(False)
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)
        assert one.abs().max() > 0.1
        for n in g_two:
            torch.testing.assert_close(g_one[n], g_two[n], rtol=1e-4, atol=1e-5, msg=n)
        assert g_one["z.weight"].abs().max() > 0 and g_one["readout.W_K.weight"].abs().max() > 0


def test_part_likelihood_is_chapter_7_plus_log_normaliser():
    torch.manual_seed(5)
    B, K, N = 3, 4, 6
    f = dict(dtype=torch.float64)
    x, votes = torch.randn(B, N, 6, **f), torch.randn(B, K, N, 6, **f)
    scales, a, d = 0.4 + torch.rand(B, K, N, **f), torch.rand(B, K, N, **f), torch.rand(B, N, **f)
    ll, post = part_pose_likelihood(x, d, votes, scales, a.log())
    flat = lambda t: t.transpose(1, 2).reshape(B * N, K, *t.shape[3:])
    ch7 = gmm_log_likelihood(x.reshape(B * N, 1, 6), torch.ones(B * N, 1, dtype=torch.bool), flat(votes),
                             flat(scales), flat(a.log()), background=0.01).view(B, N)
    torch.testing.assert_close(ll, (d * (ch7 + (a.sum(1) + 0.01).log())).sum(-1))
    assert (post.sum(-1) < 1).all() and (post >= 0).all()
    with pytest.raises(ValueError, match="expected x"):
        part_pose_likelihood(x[:, :3], d, votes, scales, a.log())


def test_gradients_stop_where_the_official_code_stops_them():
    torch.manual_seed(0)
    model = SCAE(SCAEConfig(**SMALL))
    x, _ = load_mnist(True, sample=True)
    images = next(iter(CanvasBatches(x[:8], torch.zeros(8, dtype=torch.long), batch_size=8)))[0]
    with torch.no_grad():
        shown = model.eval()(images)
    assert shown.reconstruction.shape == (8, 1, 40, 40) and shown.means.shape == (8, 6, 40, 40)
    # the reconstruction is the ink of each pixel's most probable component
    best = shown.mixing_logits.argmax(1, keepdim=True)
    assert torch.equal(shown.reconstruction, shown.means.gather(1, best))
    out = model.train()(images)
    assert out.object_presence.shape == (8, 4) and out.reconstruction is None

    def touched(loss):
        model.zero_grad()
        loss.backward(retain_graph=True)
        return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}

    part, image = touched(out.losses["part_nll"]), touched(out.losses["image_nll"])
    assert "part_encoder.head.weight" in part and "part_encoder.cnn.0.weight" in part   # via z_n
    assert not {"decoder.template_logits", "decoder.alpha_logits", "decoder.colour.0.weight"} & part
    assert not {n for n in image if n.split(".")[0] in ("encoder", "h_caps", "h_part", "op_static", "bias")}
    assert {"decoder.template_logits", "decoder.alpha_logits", "part_encoder.bias"} <= image
    # every term of Eq. (11.3) with its official weight
    cfg = model.config
    total = (out.losses["image_nll"] + out.losses["part_nll"]
             + sum(getattr(cfg, k) * out.losses[k] for k in ("dynamic_l2", "prior_within", "prior_between",
                                                             "posterior_within", "posterior_between")))
    torch.testing.assert_close(out.loss, total)


def test_noise_only_in_training_and_bad_inputs_refused():
    torch.manual_seed(0)
    model = SCAE(SCAEConfig(**SMALL)).eval()
    images = torch.rand(2, 1, 40, 40)
    a, b = model(images), model(images)
    assert torch.equal(a.object_presence, b.object_presence)
    model.train()
    assert not torch.equal(model(images).part_presence, model(images).part_presence)
    with pytest.raises(ValueError, match=r"expected images \[B, 1, 40, 40\]"):
        model(torch.rand(2, 1, 28, 28))
    with pytest.raises(ValueError, match="presence_mask"):
        SCAEConfig(presence_mask="soft")
    with pytest.raises(ValueError, match="prior_between must be a finite number"):
        SCAEConfig(prior_between=float("nan"))


def test_kmeans_accuracy_on_known_clusters():
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(10, 8)) * 4
    y_tr, y_te = rng.integers(0, 10, 600), rng.integers(0, 10, 300)
    perm = rng.permutation(10)
    acc = kmeans_accuracy(centres[y_tr] + rng.normal(size=(600, 8)) * 0.05, perm[y_tr],
                          centres[y_te] + rng.normal(size=(300, 8)) * 0.05, perm[y_te], n_init=3)
    assert acc == {"train": 1.0, "test": 1.0, "test_refit": 1.0}
    # two classes merged into one blob: at most 9 of 10 classes right
    merged = np.where(y_te == 3, 4, y_te)
    worse = kmeans_accuracy(centres[y_tr] + rng.normal(size=(600, 8)) * 0.05, y_tr,
                            centres[merged] + rng.normal(size=(300, 8)) * 0.05, y_te, n_init=3)
    assert worse["test"] == pytest.approx(1 - (y_te == 3).mean())
    # the confusion matrix says where: every test 3 counted under 4, every other digit on the diagonal
    conf = np.array(kmeans_accuracy(centres[y_tr] + rng.normal(size=(600, 8)) * 0.05, y_tr,
                                    centres[merged] + rng.normal(size=(300, 8)) * 0.05, y_te, n_init=3,
                                    confusion=True)["test_confusion"])
    assert conf.sum() == 300 and conf[3, 4] == (y_te == 3).sum() and conf[3, 3] == 0
    assert (np.diag(conf) == np.bincount(y_te, minlength=10) * (np.arange(10) != 3)).all()
    # each test digit's matched label: the test 3s read as 4, the rest as themselves
    pred = kmeans_accuracy(centres[y_tr] + rng.normal(size=(600, 8)) * 0.05, y_tr,
                           centres[merged] + rng.normal(size=(300, 8)) * 0.05, y_te, n_init=3,
                           labels=True)["test_labels"]
    assert (pred == merged).all()


def test_training_resumes_exactly(tmp_path):
    def run(steps, resume=False):
        torch.manual_seed(0)
        model = SCAE(SCAEConfig(**SMALL))
        return train_scae(model, steps, out=tmp_path / "run", resume=resume, batch_size=4, sample=True,
                          progress=False, log_every=1, checkpoint_every=1, eval_every=0, eval_n=40)
    torch.manual_seed(0)
    straight = train_scae(SCAE(SCAEConfig(**SMALL)), 4, batch_size=4, sample=True, progress=False,
                          log_every=1, eval_n=40)
    run(2)
    resumed = run(4, resume=True)
    for (n, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    assert [r["loss"] for r in straight.history] == [r["loss"] for r in resumed.history]
    model, ck = load_scae(tmp_path / "run" / "last.pt")
    assert ck["step"] == 4 and not model.training


def test_command_line_and_shipped_weights(tmp_path, capsys):
    from capsule_book import cli, weights
    out = tmp_path / "run"
    small = ["--sample", "--batch-size", "4", "--eval-n", "40", "--n-parts", "5", "--n-objects", "4",
             "--device", "cpu", "--no-progress"]
    assert cli.main(["train", "scae", "--steps", "2", "--out", str(out), *small]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["step"] == 2 and 0 <= row["eval_prior_test"] <= 1
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "scae", "--steps", "2", "--average", "1.5", "--out", str(tmp_path / "x"), *small])
    assert e.value.code == 2 and "--average must lie in [0, 1)" in capsys.readouterr().err
    ev = ["eval", "scae", "--checkpoint", str(out / "last.pt"), "--sample", "--n-train", "300",
          "--n-test", "200", "--device", "cpu"]
    assert cli.main(ev) == 0
    said = capsys.readouterr()
    scores = json.loads(said.out.strip().splitlines()[-1])
    assert scores["n_train"] == 300 and 0 <= scores["centred_prior_test"] <= 1
    # the confusion matrix of each test set agrees with its accuracy
    conf = np.array(scores["shifted_prior_test_confusion"])
    assert conf.sum() == 200 and round(np.trace(conf) / 200, 4) == scores["shifted_prior_test"]
    # the mean presences by digit are those of the model's own presences of the centred digits
    from capsule_book.data import CanvasBatches, load_mnist
    from capsule_book.scae import load_scae, scae_features
    x, y = load_mnist(False, sample=True, limit=200)
    te = scae_features(load_scae(out / "last.pt")[0], CanvasBatches(x, y, 500, 40, shift=False))
    for f in ("prior", "posterior"):
        want = [te[f][te["label"] == d].mean(0) for d in range(10)]
        np.testing.assert_allclose(scores[f"centred_{f}_test_by_class"], want, atol=1e-4)
    # a progress bar per set of digits, on stderr; none with --no-progress, and the same scores
    assert all(f"{s} digits" in said.err for s in ("training", "shifted test", "centred test"))
    assert cli.main(ev + ["--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert "digits" not in quiet.err and json.loads(quiet.out.strip().splitlines()[-1]) == scores
    weights.ship(out / "last.pt", "tiny-scae", "capsule-book train scae ...", {"test_accuracy": 0.1},
                 dtype="float16", folder=tmp_path / "w")
    model = weights.load("tiny-scae", folder=tmp_path / "w")
    with torch.no_grad():
        o = model(torch.rand(3, 1, 40, 40))
    assert not model.training and o.object_presence.shape == (3, 4)
    assert ((0 <= o.object_presence) & (o.object_presence <= 1)).all()


def test_official_part_layout_is_the_official_reshape_and_old_runs_resume(tmp_path):
    from capsule_book.pcae import PartEncoder
    from capsule_book.scae import scae_run_config
    torch.manual_seed(0)
    paper, official = PartEncoder(), PartEncoder(layout="official")
    official.load_state_dict(paper.state_dict())
    x = torch.rand(3, 1, 40, 40)
    with torch.no_grad():
        mine = torch.cat([paper(x)[0], paper(x)[1], paper(x)[2][..., None]], -1)          # [3, 40, 23]
        theirs = torch.cat([official(x)[0], official(x)[1], official(x)[2][..., None]], -1)
    # the official code: pooled [B, d, N] (values laid out dimension-major), then reshaped to [B, N, d]
    assert torch.equal(theirs, mine.transpose(1, 2).reshape(3, 40, 23))
    assert not torch.allclose(theirs, mine)
    with pytest.raises(ValueError, match="layout must be 'part' or 'official'"):
        PartEncoder(layout="transpose")
    # a run records the new setting only when it is not the default: runs made before it resume
    assert "part_layout" not in scae_run_config(SCAEConfig())
    assert scae_run_config(SCAEConfig(part_layout="official"))["part_layout"] == "official"
    assert SCAE({k: v for k, v in scae_run_config(SCAEConfig()).items()}).config.part_layout == "part"


def test_freeze_pcae_trains_the_ocae_alone(tmp_path):
    "scae_task(freeze_pcae=True): the PCAE ends exactly as it began, the OCAE moves; resumes only frozen."
    from capsule_book.train import CheckpointError
    torch.manual_seed(0)
    model = SCAE(SCAEConfig(**SMALL))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = train_scae(model, 3, out=tmp_path, batch_size=4, sample=True, progress=False, eval_n=20,
                     freeze_pcae=True)
    after = run.model.state_dict()
    from capsule_book.scae import PCAE_STAGES
    pcae = [k for k in before if k.split(".")[0] in PCAE_STAGES]
    ocae = [k for k in before if k not in pcae]
    assert pcae and ocae
    for k in pcae:
        assert torch.equal(after[k], before[k]), k
    assert sum(not torch.equal(after[k], before[k]) for k in ocae) >= len(ocae) // 2
    # the run records the setting: resumed without it, it is refused
    with pytest.raises(CheckpointError, match="freeze_pcae"):
        train_scae(SCAE(SCAEConfig(**SMALL)), 4, out=tmp_path, resume=True, batch_size=4, sample=True,
                   progress=False, eval_n=20)
    resumed = train_scae(SCAE(SCAEConfig(**SMALL)), 4, out=tmp_path, resume=True, batch_size=4,
                         sample=True, progress=False, eval_n=20, freeze_pcae=True)
    assert resumed.step == 4
    for k in pcae:
        assert torch.equal(resumed.model.state_dict()[k], before[k]), k


def test_frozen_step_leaves_out_the_image_term_and_learns_the_same(tmp_path):
    """With the PCAE frozen, the image likelihood is a constant: leaving it out changes the loss by
    exactly its image term and no gradient; scae_task(freeze_pcae=True) leaves it out, and its rows say so."""
    from capsule_book.scae import PCAE_STAGES, scae_task
    model = SCAE(SCAEConfig(**SMALL))
    for stage in PCAE_STAGES:
        getattr(model, stage).requires_grad_(False)
    x, y = load_mnist(True, sample=True)
    images, _ = next(iter(CanvasBatches(x[:8], y[:8], batch_size=8, shuffle=True, seed=3)))
    def step(image_likelihood):
        model.zero_grad()
        torch.manual_seed(5)                                  # the same part and object noise
        out = model(images, image_likelihood=image_likelihood)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    (whole, g_whole), (frozen, g_frozen) = step(True), step(False)
    assert "image_nll" not in frozen.losses and frozen.image_log_likelihood is None
    assert whole.losses["image_nll"].item() > 0
    assert torch.allclose(whole.loss - whole.losses["image_nll"], frozen.loss, rtol=0, atol=1e-3)
    assert g_whole.keys() == g_frozen.keys() and len(g_whole) > 0
    for n in g_whole:
        assert torch.equal(g_whole[n], g_frozen[n]), n
    # in evaluation mode, no mixture without the image term; with it, the reconstruction
    model.eval()
    lean, whole = model(images, image_likelihood=False), model(images)
    assert lean.reconstruction is None and whole.reconstruction.shape == images.shape
    for k in ("object_presence", "posterior_presence"):              # what evaluation reads
        assert torch.equal(getattr(lean, k), getattr(whole, k)), k
    # the task: frozen rows carry no image term, unfrozen ones do
    for freeze in (True, False):
        task = scae_task(SCAE(SCAEConfig(**SMALL)), batch_size=4, sample=True, eval_n=20,
                         freeze_pcae=freeze)
        batch = next(iter(CanvasBatches(x[:4], y[:4], batch_size=4)))
        _, terms = task.loss(task.model.train(), batch)
        assert ("image_nll" in terms) == (not freeze)


def test_pcae_fields_are_the_settings_the_pcae_is_built_from():
    """PCAE_FIELDS (what scae_from_pcae compares) holds every setting the PCAE's modules depend on:
    changing any other leaves their weights and outputs as they were; changing one of them does not."""
    from dataclasses import fields, replace
    from capsule_book.scae import PCAE_FIELDS, PCAE_STAGES
    other_text = {"presence_mask": "log", "part_layout": "official"}
    def changed(cfg, name):
        v = getattr(cfg, name)
        if isinstance(v, bool): return replace(cfg, **{name: not v})
        if isinstance(v, int): return replace(cfg, **{name: v + 1})
        if isinstance(v, float): return replace(cfg, **{name: v * 0.5 + 0.01})
        if v is None: return replace(cfg, **{name: 1.5})
        assert name in other_text, f"no other value of {name} to try: add one to other_text"
        return replace(cfg, **{name: other_text[name]})
    def pcae_of(cfg):
        torch.manual_seed(0)
        model = SCAE(cfg, seed=0).eval()
        x, y = load_mnist(True, sample=True)
        images = place_on_canvas(x[:3].float() / 255, torch.full((3, 2), 4), cfg.canvas)
        with torch.no_grad():
            pose_raw, z, logit = model.part_encoder(images)
            pose = geometric_transform(pose_raw, similarity=False)
            d, c = torch.sigmoid(logit), model.decoder.colours(z)
            ll = model.decoder(images, pose, d, c)[0]
        state = {(s, k): v for s in PCAE_STAGES for k, v in getattr(model, s).state_dict().items()}
        return state, [pose_raw, z, logit, c, ll]
    base = SCAEConfig(**SMALL)
    state0, out0 = pcae_of(base)
    same = lambda a, b: a.shape == b.shape and torch.equal(a, b)
    for f in fields(SCAEConfig):
        state, out = pcae_of(changed(base, f.name))
        unchanged = (state.keys() == state0.keys() and all(same(state[k], state0[k]) for k in state)
                     and all(same(a, b) for a, b in zip(out, out0)))
        assert unchanged == (f.name not in PCAE_FIELDS), f.name


def test_two_stages_through_the_command_line(tmp_path, capsys):
    "train scae --pcae-only, then --from-pcae (frozen or not); each resumes; wrong starts refused in one line."
    from capsule_book import cli
    from capsule_book.scae import PCAE_ONLY
    small = ["--sample", "--batch-size", "4", "--eval-n", "20", "--n-parts", "5", "--n-objects", "4",
             "--device", "cpu", "--no-progress"]
    train = lambda out, *more: cli.main(["train", "scae", "--out", str(tmp_path / out), *small, *more])
    assert train("pcae", "--steps", "2", "--pcae-only") == 0
    assert train("pcae", "--steps", "3", "--pcae-only", "--resume") == 0
    pcae, ck = load_scae(tmp_path / "pcae" / "last.pt")
    assert ck["step"] == 3 and all(getattr(pcae.config, k) == 0 for k in PCAE_ONLY)
    first = tmp_path / "pcae" / "last.pt"
    for out, frozen in (("whole", []), ("frozen", ["--freeze-pcae"])):
        assert train(out, "--steps", "2", "--from-pcae", str(first), *frozen) == 0
        capsys.readouterr()
        assert train(out, "--steps", "3", "--from-pcae", str(first), "--resume", *frozen) == 0
        assert "--from-pcae" in capsys.readouterr().err           # said: the run's own checkpoint
        model, ck = load_scae(tmp_path / out / "last.pt")
        assert ck["step"] == 3 and model.config.prior_within == SCAEConfig().prior_within
        moved = not torch.equal(model.decoder.template_logits, pcae.decoder.template_logits)
        assert moved != bool(frozen)                # the PCAE trains on, or stays exactly as it was
        assert ck["config"].get("freeze_pcae", False) == bool(frozen)
    # the third stage: both parts learn again from the frozen run's whole SCAE, which it starts with exactly
    frozen, _ = load_scae(tmp_path / "frozen" / "last.pt")
    assert train("third", "--steps", "2", "--from-scae", str(tmp_path / "frozen" / "last.pt")) == 0
    capsys.readouterr()
    assert train("third", "--steps", "3", "--from-scae", str(tmp_path / "frozen" / "last.pt"), "--resume") == 0
    assert "--from-scae" in capsys.readouterr().err
    third, ck = load_scae(tmp_path / "third" / "last.pt")
    assert ck["step"] == 3 and "freeze_pcae" not in ck["config"]
    assert not torch.equal(third.decoder.template_logits, frozen.decoder.template_logits)
    assert not torch.equal(next(third.h_caps.parameters()), next(frozen.h_caps.parameters()))
    from capsule_book.scae import scae_from_scae
    start = scae_from_scae(tmp_path / "frozen" / "last.pt")
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in frozen.state_dict().items())
    # refused, each in one line with exit status 2
    for argv, said in ((["--from-pcae", str(first)], "--from-scae starts from a whole SCAE"),
                       (["--n-objects", "3"], "holds an SCAE with n_objects=4; this run asks for n_objects=3")):
        with pytest.raises(SystemExit) as e:
            train("bad", "--steps", "1", "--from-scae", str(tmp_path / "frozen" / "last.pt"), *argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "Traceback" not in err, err
    train("whole-scae", "--steps", "1")
    for argv, said in (([str(tmp_path / "whole-scae" / "last.pt")], "not a PCAE-alone run"),
                       ([str(first), "--n-parts", "6"], "holds a PCAE with n_parts=5"),
                       ([str(first), "--pcae-only"], "--pcae-only is the first stage, --from-pcae")):
        with pytest.raises(SystemExit) as e:
            train("bad", "--steps", "1", "--from-pcae", *argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:
        train("bad", "--steps", "1", "--freeze-pcae")
    assert e.value.code == 2 and "--freeze-pcae needs a trained PCAE" in capsys.readouterr().err
    # the first stage on from a checkpoint's weights, with a fresh optimiser: the OCAE (no loss reaches it) stays
    # the checkpoint's, not a fresh one of seed 1, and the PCAE learns
    assert train("pcae-on", "--steps", "1", "--pcae-only", "--from-scae", str(first), "--seed", "1") == 0
    on, ck = load_scae(tmp_path / "pcae-on" / "last.pt")
    assert ck["step"] == 1 and all(getattr(on.config, k) == 0 for k in PCAE_ONLY)
    assert all(torch.equal(p, q) for p, q in zip(on.h_caps.parameters(), pcae.h_caps.parameters()))
    assert not torch.equal(on.decoder.template_logits, pcae.decoder.template_logits)
    # the prior between-example weight (sixteenfold at batch 32 matches the official balance at 128)
    assert train("between", "--steps", "1", "--prior-between", "5.6") == 0
    assert load_scae(tmp_path / "between" / "last.pt")[0].config.prior_between == 5.6
    with pytest.raises(SystemExit) as e:
        train("bad", "--steps", "1", "--prior-between", "-1")
    assert e.value.code == 2 and "--prior-between" in capsys.readouterr().err
    # the posterior weights, each its own flag; the others keep the official values
    assert train("posterior", "--steps", "1", "--posterior-within", "2.8", "--posterior-between", "0") == 0
    cfg = load_scae(tmp_path / "posterior" / "last.pt")[0].config
    assert (cfg.posterior_within, cfg.posterior_between, cfg.prior_between) == (2.8, 0.0, 0.35)
    with pytest.raises(SystemExit) as e:
        train("bad", "--steps", "1", "--posterior-within", "-0.5")
    assert e.value.code == 2 and "--posterior-within" in capsys.readouterr().err




def test_learning_curve_figure_reads_the_evaluations(tmp_path, capsys):
    "benchmarks/scae_curves.py: only evaluation rows are drawn; the best prior accuracy is reported."
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import scae_curves
    rows = [{"step": 100, "epoch": 0.2, "loss": 1.0, "elapsed_s": 60.0},
            {"step": 200, "epoch": 0.4, "loss": 0.9, "elapsed_s": 120.0, "eval_prior_test": 0.4,
             "eval_posterior_test": 0.5},
            {"step": 300, "epoch": 0.6, "loss": 0.8, "elapsed_s": 180.0, "eval_prior_test": 0.3,
             "eval_posterior_test": 0.6}]
    f = tmp_path / "scae_toy.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "scae_none.jsonl").write_text(json.dumps(rows[0]) + "\n")
    runs = scae_curves.main([str(f), str(tmp_path / "scae_none.jsonl"), "--out", str(tmp_path / "c.png")])
    assert list(runs) == ["toy"] and [r["step"] for r in runs["toy"]] == [200, 300]
    out = capsys.readouterr().out
    assert "last step 300 prior / posterior 0.300 / 0.600; best prior 0.400 at step 200" in out
    assert (tmp_path / "c.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        scae_curves.main([str(tmp_path / "scae_none.jsonl"), "--out", str(tmp_path / "d.png")])


def test_part_capsule_scores_read_the_class_from_the_parts():
    """benchmarks/scae_pcae_only.py --parts: the part capsules of even an untrained PCAE carry the digit's class (a
    linear probe far above chance on the shipped sample), and the scores follow the labels (shuffled, chance)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import scae_pcae_only
    from capsule_book.data import CanvasBatches, load_mnist
    torch.manual_seed(0)
    model = SCAE(seed=0)
    on_canvas = lambda x, y: CanvasBatches(x[:1000], y[:1000], 250, 40, shuffle=False, seed=1)
    train = scae_pcae_only.part_capsules(model, on_canvas(*load_mnist(True, sample=True)))
    test = scae_pcae_only.part_capsules(model, on_canvas(*load_mnist(False, sample=True)))
    assert train["pose"].shape == (1000, 240) and train["features"].shape == (1000, 640)
    assert model.training                                  # scored without noise, its mode restored
    scores = scae_pcae_only.part_scores(train, test, n_init=1)
    assert 0 <= scores["parts_present"] <= 40
    assert scores["all_probe"] > 0.45 and scores["features_probe"] > 0.45          # chance: 0.1
    shuffled = dict(train, label=np.random.default_rng(0).permutation(train["label"]))
    assert scae_pcae_only.part_scores(shuffled, test, n_init=1)["all_probe"] < 0.25
