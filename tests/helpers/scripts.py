"""Import a script that is not part of a package (``benchmarks/*.py``) by its path, for tests that
call its functions.  The module is registered under its file name for the test's duration only
(``monkeypatch``), so scripts that import their sibling scripts by name find them once those are
loaded first."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(monkeypatch, relative_path: str):
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module
