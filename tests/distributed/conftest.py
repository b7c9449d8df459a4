"""Make ``tests.distributed.*`` and ``tests.helpers.*`` importable however pytest is invoked."""
import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
