"""Where the benchmarks read and write: the repository root, the one results tree, the data folder."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DATA = REPO / "benchmarks" / "data"
