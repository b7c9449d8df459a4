"""The script ``notebooks/build.py``: the committed notebooks match the percent-format sources it
builds them from, and carry no outputs.

Executing them is CI's ``pytest --nbmake notebooks/*.ipynb`` (scripts/test.sh); these checks
are the cheap part: a notebook edited by hand (or a source edited without rebuilding) fails here,
and so does a notebook committed with outputs.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _build_module():
    spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_source_has_a_committed_notebook_that_matches_it():
    build = _build_module()
    sources = sorted((NOTEBOOKS / "src").glob("[0-9]*.py"))
    assert [s.stem for s in sources] == sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert len(sources) >= 4
    assert build.main(["--check"]) == 0, "run: python notebooks/build.py"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_valid_and_has_outputs_cleared(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and nb.cells[0].cell_type == "markdown"
    assert all(c.outputs == [] and c.execution_count is None for c in code)


def test_parse_cells_splits_code_and_markdown():
    build = _build_module()
    text = "ignored\n# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n\n# %%\n\n# %%\ny = 2\n"
    assert build.parse_cells(text) == [("markdown", "# Title\n\ntext"), ("code", "x = 1"), ("code", "y = 2")]
    with pytest.raises(ValueError, match="does not start with"):
        build.parse_cells("# %% [markdown]\nnot a comment\n")
