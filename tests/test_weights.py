"""Shipped weights: every manifest entry matches its file and loads as a working model; the download path checks
the sha256 (tested with a local stand-in for the repository, never the network)."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from capsule_book import weights
from capsule_book.capsnet import TrainConfig, train_capsnet
from capsule_book.train import CheckpointError, UserError, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = json.loads((ROOT / "weights" / "manifest.json").read_text())["models"]


def test_the_package_finds_the_checkouts_weights():
    assert weights.checkout_weights() == ROOT / "weights"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_each_shipped_file_matches_its_entry(name):
    e = MANIFEST[name]
    path = ROOT / "weights" / e["file"]
    assert path.stat().st_size == e["bytes"] and weights.sha256(path) == e["sha256"]
    assert e["command"].startswith("capsule-book train ") and e["model"] in weights.BUILDERS
    model = weights.load(name)
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", sorted(n for n, e in MANIFEST.items()
                                         if e["model"] == "capsnet" and not e["config"].get("canvas")))
def test_shipped_capsnets_classify_the_sample(name):
    from capsule_book.capsnet import evaluate
    from capsule_book.data import MNISTBatches, load_mnist
    x, y = load_mnist(False, sample=True)                         # the first 1,000 MNIST test digits
    res = evaluate(weights.load(name), MNISTBatches(x, y, 250))
    assert res["accuracy"] >= 0.98, res                           # the full test set's figure is in the manifest


@pytest.mark.parametrize("name", sorted(n for n, e in MANIFEST.items()
                                         if e["model"] == "cnn" or e["config"].get("canvas")))
def test_shipped_40x40_networks_classify_the_sample_at_its_offsets_and_in_new_poses(name):
    """Chapter 4b's networks on the first 1,000 test digits: the expanded set near its 99.2%, the affine set near the
    manifest's figure for all 10,000 (within 5 points: a sample of 1,000 scatters by about 1)."""
    from capsule_book.robustness import robustness_report
    res = robustness_report(weights.load(name), sample=True)
    assert res["n"] == 1000 and res["expanded_accuracy"] >= 0.98, res
    assert abs(res["affine_accuracy"] - MANIFEST[name]["metric"]["affine_accuracy"]) <= 0.05, res


@pytest.mark.parametrize("name", sorted(n for n, e in MANIFEST.items() if e["model"] == "mog"))
def test_shipped_mog_models_score_their_benchmark(name):
    from capsule_book.mog import evaluate_mog, mog_benchmark
    e = MANIFEST[name]
    sets, _ = mog_benchmark(10, n_min=e["eval"]["n_min"], n_max=e["eval"]["n_max"])   # 10 of its 100 batches
    assert abs(evaluate_mog(weights.load(name), sets) - e["metric"]["ll"]) < 0.1


@pytest.fixture(scope="module")
def shipped_once(tmp_path_factory):
    "A one-step CapsNet run shipped as 'tiny' (its 98 MB checkpoint deleted), and the run's model."
    tmp = tmp_path_factory.mktemp("shipped")
    run = train_capsnet(TrainConfig(steps=1, batch_size=8, limit_train=8, limit_test=8, routing_iterations=1,
                                    sample=True, progress=False, device="cpu", out=str(tmp / "run")))
    weights.ship(tmp / "run" / "last.pt", "tiny", "capsule-book train capsnet --steps 1", {"accuracy": 0.1},
                 dtype="float16", folder=tmp / "repo")
    shutil.rmtree(tmp / "run")
    return tmp / "repo", run.model


@pytest.fixture
def shipped(shipped_once, tmp_path, monkeypatch):
    "The shipped folder as tmp_path/repo (the 16 MB file a hard link: tests that change it copy it first)."
    repo, model = shipped_once
    (tmp_path / "repo").mkdir()
    shutil.copy(repo / "manifest.json", tmp_path / "repo" / "manifest.json")
    os.link(repo / "tiny.pt", tmp_path / "repo" / "tiny.pt")
    monkeypatch.delenv("CAPSULE_BOOK_WEIGHTS", raising=False)
    return tmp_path, model


def test_ship_then_load_gives_the_same_function(shipped):
    tmp, model = shipped
    back = weights.load("tiny", folder=tmp / "repo")
    x = torch.rand(2, 1, 28, 28)
    with torch.no_grad():
        a, b = model.eval()(x).caps, back(x).caps
    torch.testing.assert_close(b, a, rtol=0, atol=1e-2 * a.abs().max().item())     # float16: 3 significant digits
    e = weights.entry("tiny", folder=tmp / "repo")
    assert e["steps"] == 1 and e["config"]["routing_iterations"] == 1 and e["dtype"] == "float16"


def test_download_path_checks_the_sha256(shipped, monkeypatch):
    tmp, _ = shipped
    served = []

    def fake_urlopen(url, timeout=None):                          # the repository's raw files, served from disk
        served.append(url)
        return open(tmp / "repo" / url.rsplit("/", 1)[-1], "rb")

    monkeypatch.setattr(weights, "checkout_weights", lambda: None)
    monkeypatch.setattr(weights.urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setenv("CAPSULE_BOOK_DATA", str(tmp / "cache"))
    model = weights.load("tiny")
    assert not model.training and served[-1].endswith(f"/v{weights.__version__}/weights/tiny.pt")
    n = len(served)
    weights.load("tiny")
    assert len(served) == n                                       # downloaded once, then read from the cache
    cached = weights.cache_weights() / "tiny.pt"
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0xFF                                  # one byte of a download changed
    cached.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is not the shipped model \(delete it to download it again\)$"):
        weights.load("tiny")
    cached.unlink()
    with pytest.raises(UserError, match="missing"):
        weights.load("tiny", download=False)


def test_unknown_names_and_missing_files_are_refused(shipped):
    tmp, _ = shipped
    with pytest.raises(UserError, match="no shipped model 'nope'; shipped: tiny"):
        weights.load("nope", folder=tmp / "repo")
    (tmp / "repo" / "tiny.pt").unlink()
    with pytest.raises(UserError, match="retrain with: capsule-book train capsnet --steps 1"):
        weights.load("tiny", folder=tmp / "repo")


def test_shipped_scae_classifies_the_sample_without_labels():
    """Chapter 11's `scae-mnist`: its object presences are [B, 32] probabilities, and K-means on those of the sample's
    2,000 training digits, matched to labels, classifies its 1,000 test digits near the manifest's figure for all
    10,000 (within 5 points: K-means on 2,000 digits scatters more than on 60,000)."""
    from capsule_book.data import CanvasBatches, load_mnist
    from capsule_book.scae import kmeans_accuracy, scae_features
    model, e = weights.load("scae-mnist"), MANIFEST["scae-mnist"]
    train, test = (CanvasBatches(*load_mnist(s, sample=True), 500, 40, seed=seed)
                   for s, seed in ((True, 10_001), (False, 10_002)))
    with torch.no_grad():
        u = model(next(iter(test))[0][:4], image_likelihood=False).object_presence
    assert u.shape == (4, 32) and 0 <= u.min() and u.max() <= 1 and (u.max(1).values > 0.5).all()
    tr, te = scae_features(model, train), scae_features(model, test)
    res = kmeans_accuracy(tr["prior"], tr["label"], te["prior"], te["label"])
    assert res["test"] >= 0.9 and abs(res["test"] - e["metric"]["kmeans_prior"]) <= 0.05, res


def test_shipped_ccae_segments_fresh_constellations():
    from capsule_book.ccae import evaluate_ccae
    e = MANIFEST["ccae"]
    res = evaluate_ccae(weights.load("ccae"), n=1000)                # 1,000 of the manifest's 10,000
    assert abs(res["accuracy"] - e["metric"]["accuracy"]) < 0.03, res
    assert res["accuracy"] > res["one_capsule_baseline"] + 0.2


def test_a_changed_file_in_a_clone_is_restored_with_the_git_command_the_message_gives(shipped):
    tmp, _ = shipped
    clone = tmp / "clone"
    (clone / "weights").mkdir(parents=True)
    for f in ("manifest.json", "tiny.pt"): shutil.copy(tmp / "repo" / f, clone / "weights" / f)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q", str(clone)], check=True)
    subprocess.run(git + ["-C", str(clone), "add", "weights"], check=True)
    subprocess.run(git + ["-C", str(clone), "commit", "-q", "-m", "weights"], check=True)
    with open(clone / "weights" / "tiny.pt", "ab") as f: f.write(b"x")
    with pytest.raises(CheckpointError, match=r"is not the shipped model \(restore it with `git -C .*`\)$") as e:
        weights.load("tiny", folder=clone / "weights")
    command = str(e.value).split("`")[1]
    assert command == f"git -C {clone.resolve()} checkout -- weights/tiny.pt"
    subprocess.run(command.split(), check=True)                                 # what the message says works
    assert not weights.load("tiny", folder=clone / "weights").training


def test_a_changed_file_outside_a_clone_says_where_the_right_one_is(shipped):
    tmp, _ = shipped
    copy = tmp / "copy"
    copy.mkdir()
    for f in ("manifest.json", "tiny.pt"): shutil.copy(tmp / "repo" / f, copy / f)
    with open(copy / "tiny.pt", "ab") as f: f.write(b"x")
    with pytest.raises(CheckpointError, match=rf"\(copy weights/tiny.pt of {weights.REPOSITORY} at "
                                              rf"v{weights.__version__} over it\)$"):
        weights.load("tiny", folder=copy)


def test_the_weights_folder_of_the_environment_is_read_first(shipped, monkeypatch):
    tmp, model = shipped
    monkeypatch.setattr(weights.urllib.request, "urlopen", None)                 # no download, ever
    monkeypatch.setenv("CAPSULE_BOOK_WEIGHTS", str(tmp / "repo"))
    assert weights.local_weights() == tmp / "repo" and set(weights.manifest()["models"]) == {"tiny"}
    assert not weights.load("tiny").training
    monkeypatch.setenv("CAPSULE_BOOK_WEIGHTS", str(tmp))
    with pytest.raises(UserError, match=rf"^{tmp} holds no manifest.json: --weights-dir \(or CAPSULE_BOOK_WEIGHTS\)"):
        weights.load("tiny")


def test_a_network_trained_in_two_runs_ships_with_both_runs_counted(tmp_path):
    """ship_two_runs: Eq. (4.1) for 2 steps, then a 3-step cooldown from its checkpoint; the entry counts 5 steps and
    both runs' seconds, the merged curve runs 1..5 with the cooldown's rows marked, and the first run's checkpoint
    can be gone (its base.json is enough). A cooldown of another first run is refused, naming both."""
    common = dict(batch_size=8, limit_train=16, limit_test=8, routing_iterations=1, sample=True, progress=False,
                  device="cpu", log_every=1)
    train_capsnet(TrainConfig(steps=2, out=str(tmp_path / "base"), **common))
    base = weights.base_record(tmp_path / "base" / "last.pt", note="the first run")
    (tmp_path / "base.json").write_text(json.dumps(base))
    train_capsnet(TrainConfig(steps=3, cooldown_from=str(tmp_path / "base" / "last.pt"),
                              out=str(tmp_path / "cool"), **common))
    shutil.copy(tmp_path / "base" / "metrics.jsonl", tmp_path / "base-metrics.jsonl")
    shutil.rmtree(tmp_path / "base")
    cool = load_checkpoint(tmp_path / "cool" / "last.pt")
    e = weights.ship_two_runs(tmp_path / "cool" / "last.pt", tmp_path / "base.json", "two", "cmd", {"accuracy": 0.1},
                              tmp_path / "base-metrics.jsonl", tmp_path / "results" / "two.jsonl",
                              folder=tmp_path / "w")
    assert base["step"] == 2 and base["note"] == "the first run"
    assert e["steps"] == 5 and e["train_seconds"] == round(base["elapsed"] + cool["elapsed"], 1)
    assert e["metrics"] == str(tmp_path / "results" / "two.jsonl")
    assert weights.entry("two", folder=tmp_path / "w")["steps"] == 5
    rows = [json.loads(r) for r in (tmp_path / "results" / "two.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r.get("cooldown", False) for r in rows] == [False, False, True, True, True]
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(rows, rows[1:]))
    assert rows[2]["lr"] < rows[1]["lr"]                                   # the cooldown's rate, below Eq. (4.1)'s
    with pytest.raises(UserError, match="cools down from step 2, but its first run ends at step 7"):
        weights.ship_two_runs(tmp_path / "cool" / "last.pt", {**base, "step": 7}, "two", "cmd", {},
                              tmp_path / "base-metrics.jsonl", tmp_path / "x.jsonl", folder=tmp_path / "w")
    other = {**base, "config": {**base["config"], "routing_iterations": 3}}
    with pytest.raises(UserError, match="routing_iterations=1, its first run with routing_iterations=3"):
        weights.ship_two_runs(tmp_path / "cool" / "last.pt", other, "two", "cmd", {},
                              tmp_path / "base-metrics.jsonl", tmp_path / "x.jsonl", folder=tmp_path / "w")
