"""The mesh: cut positions that split the longest sequence into slices of equal time (Alg. 1, step 1).

The cumulative per-layer time of ``[0, x)`` without the per-unit constant is ``a1 x^2 + a2 x``, so
cut ``j`` of ``K`` is the root of ``a1 x^2 + a2 x = (j / K) (a1 L^2 + a2 L)`` (closed form; ``b``
cancels because every slice pays it once).  Later slices own a wider attention band, so they are
shorter; the first slice, up to rounding, is the largest.  The cuts assume the causal band; under
a profile that counts a slice's context as a masked rectangle (CPU SDPA) they are equal-band cuts,
and the cost model prices the slices by the profile's count afterwards.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from infinipipe_hf.planner.batch.layer_time import LayerTime


def equal_time_cuts(length: int, num_slices: int, lt: LayerTime) -> list[int]:
    """The ``K - 1`` interior cut positions splitting ``[0, length)`` into equal-time slices.

    ``K`` is clamped to ``length`` (a slice holds at least one token).  Cuts are rounded to
    integers and forced strictly increasing inside ``[1, length - 1]``.
    """
    k = min(num_slices, length)
    if k <= 1:
        return []
    j = np.arange(1, k, dtype=np.float64)
    total = lt.a1 * float(length) ** 2 + lt.a2 * length
    if total <= 0.0:  # a cost model with no per-token cost: equal time is equal anything
        x = length * j / k
    else:
        c = total * j / k
        # Root of a1 x^2 + a2 x = c in the form that stays exact when a1 -> 0.
        x = 2.0 * c / (lt.a2 + np.sqrt(lt.a2 * lt.a2 + 4.0 * lt.a1 * c))
    y = np.rint(x) - j.astype(np.int64)  # shift so "strictly increasing" becomes "non-decreasing"
    y = np.clip(np.maximum.accumulate(y), 0, length - k)
    return [int(v) for v in (y + j)]


def largest_slice(length: int, cuts: Sequence[int]) -> int:
    """Tokens of the largest slice: the first, up to one token of rounding."""
    if not cuts:
        return length
    return int(np.diff(np.asarray([0, *cuts, length])).max())


def mesh_for(longest: int, num_slices: int, lt: LayerTime, max_tokens: int | None) -> tuple[int, list[int]]:
    """Slice count and cuts of the longest sequence: the least K >= num_slices whose largest slice
    fits ``max_tokens`` (every sequence fits: K = L gives one-token slices)."""
    k = min(num_slices, longest)
    cuts = equal_time_cuts(longest, k, lt)
    if max_tokens is None or largest_slice(longest, cuts) <= max_tokens:
        return k, cuts
    # Bisection on K between a failing and a fitting count (K = L: one-token slices always fit),
    # seeded by the closed-form K whose unrounded first slice is exactly the cap.
    lo, hi = k, longest
    total = lt.a1 * float(longest) ** 2 + lt.a2 * longest
    cap = lt.a1 * float(max_tokens) ** 2 + lt.a2 * max_tokens
    guess = math.ceil(total / cap) if cap > 0 and total > 0 else math.ceil(longest / max_tokens)
    fits = {hi: equal_time_cuts(longest, hi, lt)}
    for probe in (guess, guess + 1):
        if lo < probe < hi:
            cuts = equal_time_cuts(longest, probe, lt)
            if largest_slice(longest, cuts) <= max_tokens:
                hi, fits[probe] = probe, cuts
                break
            lo = probe
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cuts = equal_time_cuts(longest, mid, lt)
        if largest_slice(longest, cuts) <= max_tokens:
            hi, fits[mid] = mid, cuts
        else:
            lo = mid
    return hi, fits[hi]
