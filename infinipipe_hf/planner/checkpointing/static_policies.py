"""The static whole-layer checkpoint settings baselines use: none, every layer, or one uniform count."""
from __future__ import annotations

import numpy as np

from infinipipe_hf.planner.checkpointing.problem import ReplicaProblem

_SLACK_BYTES = 1.0


def fits(prob: ReplicaProblem, columns: np.ndarray) -> bool:
    """Every device row within budget (static settings have no host rows)."""
    return len(prob.need) == 0 or bool((prob.overshoot(columns) <= _SLACK_BYTES).all())


def least_uniform(prob: ReplicaProblem) -> int | None:
    """Least single count that fits this replica (monotone: more checkpointing, less memory)."""
    top = int(prob.cell_layers.max()) if len(prob.cell_layers) else 0
    lo, hi = 0, top
    if not fits(prob, np.minimum(hi, prob.cell_layers)):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(prob, np.minimum(mid, prob.cell_layers)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def static_cells(problems: list[ReplicaProblem], policy: str) -> tuple[list[np.ndarray], list[str]]:
    """Column values and method of the static policies (whole layers: one column per cell)."""
    if policy == "uniform":
        least = [least_uniform(p) for p in problems]
        if any(c is None for c in least):
            c = max((int(p.cell_layers.max()) for p in problems if len(p.cell_layers)), default=0)
        else:
            c = max(least, default=0)
        return [np.minimum(c, p.cell_layers) for p in problems], ["uniform"]
    cells = [p.cell_layers.copy() if policy == "full" else np.zeros_like(p.cell_layers) for p in problems]
    return cells, ["full" if policy == "full" else "none-needed"]
