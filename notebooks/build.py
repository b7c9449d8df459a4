"""Build the walkthrough notebooks (``notebooks/*.ipynb``) from their sources in ``notebooks/src``.

Design: each notebook is written as a plain Python file in the "percent" format (``# %%`` starts
a code cell, ``# %% [markdown]`` a markdown cell whose lines start with ``# ``), so it is
reviewed, diffed and linted like code; this script turns them into ``.ipynb`` JSON with
``nbformat``, outputs cleared, and CI executes the ``.ipynb`` files with ``pytest --nbmake``.
``--check`` exits 1 when a committed notebook differs from its source (a unit test runs it).

Trade-off: a tiny converter instead of jupytext (not a dependency here); it supports exactly the
two cell kinds above, which is all the walkthroughs use.

Usage: ``python notebooks/build.py [--check]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``[(kind, source)]`` of a percent-format file; text before the first marker is dropped."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
        elif cells:
            kind, lines = cells[-1]
            if kind == "markdown":
                if line.strip() and not line.startswith("#"):
                    raise ValueError(f"markdown cell line does not start with '#': {line!r}")
                line = line[2:] if line.startswith("# ") else line.lstrip("#")
            lines.append(line)
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if lines:
            out.append((kind, "\n".join(lines)))
    return out


def build_notebook(src: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, source) in enumerate(parse_cells(src.read_text())):
        cell = (nbformat.v4.new_markdown_cell(source) if kind == "markdown"
                else nbformat.v4.new_code_cell(source))
        cell["id"] = f"{src.stem[:2]}-{i:02d}"  # stable ids: rebuilding gives identical files
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(src: Path) -> str:
    return nbformat.writes(build_notebook(src)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="fail if a notebook is out of date")
    args = p.parse_args(argv)
    stale = []
    for src in sorted(SRC.glob("[0-9]*.py")):
        target = HERE / f"{src.stem}.ipynb"
        text = render(src)
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python notebooks/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
