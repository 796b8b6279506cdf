"""capsule_book.data: the data root, the idx reader, the MNIST sample shipped with the package, the missing-data
error. Needs no MNIST on disk; where the full files in ../shared/data/mnist exist, the sample is checked on them."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from capsule_book.data import (DATA_ENV, MNIST_FILES, MNIST_SAMPLE_SIZE, data_root, load_mnist, mnist_sample_folder,
                               read_idx)

ROOT = Path(__file__).resolve().parents[1]
FULL_MNIST = ROOT.parent / "shared" / "data" / "mnist"      # the four original .gz files, beside the repository
IN_CI = os.environ.get("CI") == "true"


def test_data_root_is_never_relative_to_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert data_root() == Path.home() / ".cache" / "capsule_book" and data_root().is_absolute()
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "d"))
    assert data_root() == tmp_path / "d"
    assert data_root("elsewhere") == Path("elsewhere")            # an explicit root wins


FIRST_LABELS = {True: [5, 0, 4, 1, 9, 2, 1, 3, 1, 4], False: [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]}   # train, test


@pytest.mark.parametrize("train", [True, False])
def test_sample_loads_without_torchvision_download_or_data_root(train, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)          # `import torchvision` now fails
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "absent"))
    x, y = load_mnist(train, sample=True)
    n = MNIST_SAMPLE_SIZE["train" if train else "test"]
    assert x.dtype == torch.uint8 and x.shape == (n, 28, 28) and y.dtype == torch.int64 and y.shape == (n,)
    assert y[:10].tolist() == FIRST_LABELS[train] and set(y.tolist()) == set(range(10))
    assert 0 < x.float().mean() / 255 < 0.2 and int(x.max()) == 255
    xl, yl = load_mnist(train, limit=5, sample=True)
    assert torch.equal(xl, x[:5]) and torch.equal(yl, y[:5])
    assert not (tmp_path / "absent").exists()                        # the data root is not touched


def test_sample_is_package_data():
    folder = mnist_sample_folder()
    assert sorted(p.name for p in folder.glob("*.gz")) == sorted(f"{f}.gz" for f in MNIST_FILES)
    readme = (folder / "README.md").read_text()
    assert all(s in readme for s in ("Yann LeCun", "Corinna Cortes", "Christopher J.C. Burges", "CC BY-SA 3.0"))
    setup = (ROOT / "setup.py").read_text() + (ROOT / "MANIFEST.in").read_text()
    assert "mnist_sample" in setup, "setup.py / MANIFEST.in must carry capsule_book/mnist_sample into the package"


def test_sample_equals_the_first_digits_of_full_mnist():
    if not all((FULL_MNIST / f"{f}.gz").is_file() for f in MNIST_FILES):
        reason = f"the full MNIST files are not in {FULL_MNIST}"
        if IN_CI:
            pytest.fail(f"{reason}: CI runs beside ../shared, which holds them")
        print(reason)
        pytest.skip(reason)
    sample = mnist_sample_folder()
    for f in MNIST_FILES:
        full, part = read_idx(FULL_MNIST / f"{f}.gz"), read_idx(sample / f"{f}.gz")
        n = MNIST_SAMPLE_SIZE["train" if f.startswith("train") else "test"]
        assert full.shape[0] == (60_000 if n == 2000 else 10_000) and part.shape == (n,) + full.shape[1:]
        assert part.dtype == full.dtype == np.uint8 and np.array_equal(part, full[:n]), f


def test_read_idx_refuses_what_is_not_idx(tmp_path):
    (tmp_path / "x").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "x")
    (tmp_path / "y").write_bytes(b"\0\0\x08\x02" + (3).to_bytes(4, "big") + (2).to_bytes(4, "big") + b"12345")
    with pytest.raises(ValueError, match=r"holds 5 bytes .* shape \[3, 2\], needs 6"):
        read_idx(tmp_path / "y")


def test_missing_mnist_says_what_works(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_mnist(False, root=tmp_path, download=False)
    msg = str(e.value)
    raw = tmp_path / "MNIST" / "raw"
    assert str(raw) in msg and "decompressed" in msg and all(f in msg for f in MNIST_FILES)
    assert DATA_ENV in msg and "sample=True" in msg


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        load_mnist(sample=True, limit=0)
