"""Bin packing of whole sequences under a token capacity: the two policies the project uses.

``first_fit_decreasing`` builds the baselines' micro-batches (packed-1f1b, gpipe, seq1f1b,
ulysses-zero3); ``best_fit_decreasing`` fills the trainer's global batches, whose count must not
depend on the shuffle (steps per epoch, exact resume).  They pack differently on some inputs, so
both are kept; the elastic units pack under a time budget too (``batch.elastic``).
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np


def first_fit_decreasing(lengths: Sequence[int], items: Sequence[int], capacity: int) -> list[list[int]]:
    """Items longest first (ties by id), each into the first bin with room; an item over
    ``capacity`` gets a bin of its own.  Returns item ids per bin, bins in creation order."""
    order = sorted(items, key=lambda s: (-int(lengths[s]), s))
    room = np.zeros(len(order), dtype=np.int64)  # remaining tokens per open bin
    bins: list[list[int]] = []
    for s in order:
        n = int(lengths[s])
        i = -1
        if bins and n <= capacity:
            fits = room[:len(bins)] >= n
            i = int(fits.argmax())
            if not fits[i]:
                i = -1
        if i < 0:
            i = len(bins)
            bins.append([])
            room[i] = capacity if n <= capacity else n
        bins[i].append(s)
        room[i] -= n
    return bins


def best_fit_decreasing(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """Pack items (visited longest first, ties in ``order``) into bins of at most ``budget``.

    Each item goes to the fullest open bin it fits in (best fit).  Returns item indices per bin,
    bins in creation order.  Decisions depend only on the lengths, so the bin count is the same
    for every tie order.
    """
    rank = {item: pos for pos, item in enumerate(order)}
    items = sorted(order, key=lambda i: (-lengths[i], rank[i]))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin id), sorted
    for i in items:
        n = lengths[i]
        if n > budget:
            raise ValueError(f"item {i} of {n} tokens exceeds the budget of {budget}")
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            cap, b = free.pop(pos)
            bins[b].append(i)
            cap -= n
        else:
            b = len(bins)
            bins.append([i])
            cap = budget - n
        if cap > 0:
            bisect.insort(free, (cap, b))
    return bins
