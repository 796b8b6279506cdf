"""A long exported function shown in pieces: the pieces on the page are the exported code, line for line.

`fit` (Appendix C) and `ccae_train_arguments` (Appendix D) are single functions too long for one cell on the page.
Their notebooks show them as Python blocks in markdown cells with prose between, followed by the exported cell
itself, marked `#| hide` so that the page shows the pieces only. Nothing keeps the pieces and the code in
step but this test: put together, the blocks must be the cell's code."""
import json
import re
from pathlib import Path

import pytest

NBS = Path(__file__).resolve().parents[1] / "nbs"
BLOCK = re.compile(r"```python\n(.*?)\n```", re.S)


def _pieces_and_code(notebook: str) -> list[tuple[str, str, str]]:
    cells = json.loads((NBS / notebook).read_text())["cells"]
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
        code = "\n".join(l for l in lines if not l.startswith("#|"))
        found.append((c["id"], "\n".join(blocks), code))
    return found


@pytest.mark.parametrize("notebook, name", [("92_train.ipynb", "def fit("),
                                            ("93_cli.ipynb", "def ccae_train_arguments(")])
def test_the_pieces_are_the_exported_code(notebook, name):
    found = [(cid, pieces, code) for cid, pieces, code in _pieces_and_code(notebook) if name in code]
    assert len(found) == 1, f"{notebook}: no exported, hidden cell defining {name}"
    cid, pieces, code = found[0]
    assert pieces.rstrip() == code.rstrip(), f"{notebook}, cell {cid}: the pieces on the page are not its code"
    assert pieces.count("\n") >= 40
