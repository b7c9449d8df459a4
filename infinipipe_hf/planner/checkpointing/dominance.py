"""Dominated memory points: a point whose live set is contained in another's, with base bytes not larger.

Such a point binds for no choice of checkpoint counts (activations are non-negative), so the
checkpoint problem drops it.  Live sets are windows of points (:mod:`.live_windows`), so
containment is a range query: a range-maximum table answers all of a stage's points in
O(P log P).
"""
from __future__ import annotations

import numpy as np


def _range_max_table(values: np.ndarray) -> list[np.ndarray]:
    """Sparse table: entry ``k`` holds the max of every window of ``2**k`` consecutive values."""
    table = [values]
    span = 1
    while 2 * span <= len(values):
        prev = table[-1]
        table.append(np.maximum(prev[:-span], prev[span:]))
        span *= 2
    return table


def _range_max(table: list[np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Max of ``values[lo..hi]`` (inclusive) per query; ``-inf`` for empty ranges."""
    out = np.full(len(lo), -np.inf)
    ok = hi >= lo
    if not ok.any():
        return out
    lo_, hi_ = lo[ok], hi[ok]
    k = np.floor(np.log2(hi_ - lo_ + 1)).astype(np.int64)
    res = np.empty(len(lo_))
    for level in np.unique(k):
        sel = k == level
        t = table[level]
        res[sel] = np.maximum(t[lo_[sel]], t[hi_[sel] - (1 << level) + 1])
    out[ok] = res
    return out


def undominated(base: np.ndarray, firsts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
    """Mask of points no other point dominates (live superset with base at least as large).

    Ties (same base, containing live set) keep the earlier point, so of mutually dominating
    points exactly one survives.
    """
    n = len(base)
    idx = np.arange(n)
    firsts = np.minimum(firsts, idx)  # an invalid plan's windows may not contain the point itself
    lasts = np.maximum(lasts, idx)
    table = _range_max_table(base)
    before = _range_max(table, firsts, idx - 1)
    after = _range_max(table, idx + 1, lasts)
    return ~((before >= base) | (after > base))
