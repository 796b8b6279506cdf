"""The chapters' Colab cell: in Colab a chapter runs from a clone of the repository, as in a checkout."""
import json
import re
import sys
import types
from pathlib import Path

from capsule_book.weights import REPOSITORY

NBS = Path(__file__).resolve().parents[1] / "nbs"
# a chapter that reads committed files beside nbs/ (result files, weights, runs)
READS_REPOSITORY = re.compile(r"\.\./(benchmarks|weights|runs)\b")


def _colab_cells() -> dict:
    cells = {}
    for nb in sorted(NBS.glob("*.ipynb")):
        for c in json.loads(nb.read_text())["cells"]:
            src = "".join(c["source"])
            if c["cell_type"] == "code" and src.startswith("# Colab only"):
                cells[nb.name] = src
    return cells


def test_every_chapter_that_reads_the_repository_has_the_one_colab_cell():
    cells = _colab_cells()
    readers = [nb.name for nb in sorted(NBS.glob("*.ipynb"))
               if any(READS_REPOSITORY.search("".join(c["source"]))
                      for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")]
    assert readers and all(name in cells for name in readers), (readers, sorted(cells))
    assert len(set(cells.values())) == 1, "the chapters' Colab cells differ"


def _run_cell(monkeypatch, colab: bool, cloned: bool) -> tuple[list, list]:
    "Run the Colab cell with subprocess.run and os.chdir recorded instead of done."
    import os
    import subprocess
    calls, dirs = [], []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
    monkeypatch.setattr(os, "chdir", dirs.append)
    monkeypatch.setattr(os.path, "isdir", lambda p: cloned)
    monkeypatch.setattr(sys, "path", list(sys.path))
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(next(iter(_colab_cells().values())), {})
    return calls, dirs


def test_in_colab_the_cell_clones_installs_and_runs_from_the_clones_nbs(monkeypatch):
    calls, dirs = _run_cell(monkeypatch, colab=True, cloned=False)
    (clone, clone_kw), (pip, pip_kw) = calls
    repo = clone[-1]
    assert clone[:2] == ["git", "clone"] and REPOSITORY in clone and clone_kw["check"]
    assert pip[:4] == [sys.executable, "-m", "pip", "install"] and pip[-1] == repo and pip_kw["check"]
    # the clone's package is imported (it finds the clone's weights/), the chapter runs in its nbs/
    assert sys.path[0] == repo and dirs == [f"{repo}/nbs"]


def test_run_again_in_colab_the_cell_does_not_clone_again(monkeypatch):
    calls, dirs = _run_cell(monkeypatch, colab=True, cloned=True)
    assert calls == [] and len(dirs) == 1 and dirs[0].endswith("/nbs")


def test_outside_colab_the_cell_does_nothing(monkeypatch):
    before = list(sys.path)
    calls, dirs = _run_cell(monkeypatch, colab=False, cloned=False)
    assert calls == [] and dirs == [] and sys.path == before
