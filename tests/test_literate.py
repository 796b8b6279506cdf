"""Code cells short enough to read on the page.

No code cell of a chapter runs over 40 lines (every line of its source, directives included): a long class has its
methods in cells of their own after it, a long function is built from private helpers, each piece with a sentence
before it. A long exported cell may still be shown as Python blocks in the markdown cells before it, the cell itself
marked `#| hide`; nothing keeps the pieces and the code in step but this test: put together, the blocks must be the
cell's code."""
import json
import re
from pathlib import Path

import pytest

NBS = Path(__file__).resolve().parents[1] / "nbs"
BLOCK = re.compile(r"```python\n(.*?)\n```", re.S)
NOTEBOOKS = sorted(p.name for p in NBS.glob("*.ipynb"))
MAX_LINES = 40


def _cells(notebook: str) -> list[dict]:
    return json.loads((NBS / notebook).read_text())["cells"]


def _pieces_and_code(notebook: str) -> list[tuple[str, str, str]]:
    cells = _cells(notebook)
    found = []
    for i, c in enumerate(cells):
        src = "".join(c["source"])
        lines = src.splitlines()
        if c["cell_type"] != "code" or "#| hide" not in lines or "#| export" not in lines:
            continue
        blocks, j = [], i - 1
        while j >= 0 and cells[j]["cell_type"] == "markdown" and BLOCK.search("".join(cells[j]["source"])):
            blocks = BLOCK.findall("".join(cells[j]["source"])) + blocks
            j -= 1
        if not blocks:
            continue
        code = "\n".join(l for l in lines if not l.startswith("#|"))
        found.append((c["id"], "\n".join(blocks), code))
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_no_code_cell_over_40_lines(notebook):
    long = [(c["id"], n) for c in _cells(notebook) if c["cell_type"] == "code"
            for n in [len("".join(c["source"]).splitlines())] if n > MAX_LINES]
    assert not long, f"{notebook}: code cells over {MAX_LINES} lines (id, lines): {long}"


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_the_pieces_are_the_exported_code(notebook):
    for cid, pieces, code in _pieces_and_code(notebook):
        assert pieces.rstrip() == code.rstrip(), f"{notebook}, cell {cid}: the pieces on the page are not its code"
