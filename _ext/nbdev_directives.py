"""Sphinx extension of capsule_book: nbdev's cell directives never reach the rendered book.

nbdev reads lines such as `#| export`, `#| hide` or `#| echo: false` at the top of a code cell. They are tooling, not
code a reader should see, so before myst-nb parses a notebook (Sphinx's `source-read` event, which hands over the
notebook's JSON text) every such line is taken out of every code cell, and the directives that say what to show are
turned into myst-nb's own cell tags, as nbdev does in its own docs:

- `#| hide`, `#| include: false`: the whole cell is removed (`remove-cell`);
- `#| echo: false`: the code is removed, the output kept (`remove-input`);
- `#| output: false`: the output is removed, the code kept (`remove-output`).

A code cell left with neither code nor output is removed. The notebooks on disk are not changed."""
import json
import re

DIRECTIVE = re.compile(r"^\s*#\|(.*)$")


def _flags(directives: list[str]) -> set[str]:
    "The directive words that decide what is shown, normalised: 'hide', 'include:false', 'echo:false', ..."
    return {re.sub(r"\s+", "", d).lower() for d in directives}


def strip_cell(cell: dict) -> bool:
    "Take the directive lines out of a code cell, tag it as they say; False if the cell is to be dropped."
    src = cell.get("source", "")
    lines = (src if isinstance(src, str) else "".join(src)).splitlines()
    directives = [m.group(1).strip() for m in map(DIRECTIVE.match, lines) if m]
    if not directives:
        return True
    kept = [line for line in lines if not DIRECTIVE.match(line)]
    while kept and not kept[0].strip():
        kept.pop(0)
    while kept and not kept[-1].strip():
        kept.pop()
    cell["source"] = "\n".join(kept)
    flags = _flags(directives)
    if flags & {"hide", "include:false"}:
        return False
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if "echo:false" in flags:
        tags.append("remove-input")
    if "output:false" in flags:
        tags.append("remove-output")
    no_output = not cell.get("outputs") or "remove-output" in tags
    return not ((not kept or "remove-input" in tags) and no_output)


def strip_notebook(text: str) -> str:
    "The notebook JSON `text` with every code cell's nbdev directives handled (see the module's docstring)."
    nb = json.loads(text)
    nb["cells"] = [c for c in nb.get("cells", []) if c.get("cell_type") != "code" or strip_cell(c)]
    return json.dumps(nb, ensure_ascii=False)


def _on_source_read(app, docname: str, source: list) -> None:
    if str(app.env.doc2path(docname)).endswith(".ipynb"):
        source[0] = strip_notebook(source[0])


def setup(app):
    app.connect("source-read", _on_source_read)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
