"""Sequence processor: elastic units from one batch of lengths (InfiniPipe Alg. 1, docs/algorithms.md).

Every decision uses the per-layer forward+backward time ``t = a1 * sum(s^2 + 2 C s) + a2 * sum(s) + b``
(:class:`~infinipipe_hf.planner.batch.layer_time.LayerTime`):

1. The longest sequence is cut into ``K`` slices of equal time (:mod:`~infinipipe_hf.planner.batch.slice_cuts`).
   The rounded cuts are the *mesh*; the slowest slice is the *time budget*; the largest slice
   is the *token budget*.  A ``max_tokens_per_unit`` cap smaller than that raises ``K``.
2. Every sequence longer than the token budget is *long* and is cut at the same absolute mesh
   positions, so between two cuts its slice costs what the longest sequence's does; its
   remainder after its last cut is its *tail*.  Everything else is *short*.
3. Each tail seeds a bucket; short sequences, longest first, go to the bucket left with the least
   time slack that still fits both budgets (best fit, ties to the earliest); when none fits a new
   bucket opens.  A bucket with a tail becomes a hybrid unit, the others packed units, so a
   unit never holds two last slices.  Packed units keep their creation order, which puts the
   lightest leftovers last, where a pipeline's drain is on the critical path.

Trade-off: one mesh for the whole batch (the paper's choice) keeps slices of different long
sequences identical in shape, at the price of tails of arbitrary size; packing short sequences
into those tails recovers most of the lost balance (``balance()`` reports the spread).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.planner.batch.layer_time import LayerTime
from infinipipe_hf.planner.batch.select import select_sequences
from infinipipe_hf.planner.batch.slice_cuts import largest_slice, mesh_for
from infinipipe_hf.planner.cost.model import CostModel

# Relative slack on budget comparisons: times are sums of floats, budgets come from the same sums.
_REL_EPS = 1e-9


@dataclass(frozen=True)
class SlicingResult:
    """The elastic units of one batch (or one DP replica's share) for one slice count."""

    units: list[Unit]
    """EPP forward order: long sequences (most slices first, then longer first, then seq id), each
    one's slices consecutive (its tail inside a hybrid unit when short sequences joined it), then
    packed units (in creation order, i.e. by their longest member).  Ids consecutive from ``first_unit_id``."""
    num_slices: int
    """Slice count ``K`` of the longest sequence (raised by ``max_tokens_per_unit``, clamped to
    its length)."""
    mesh: list[int]
    """The ``K - 1`` absolute cut positions (increasing); the longest sequence ends after them."""
    time_budget_s: float
    """Per-layer forward+backward time of the slowest slice of the longest sequence."""
    token_budget: int
    """Tokens of the largest slice of the longest sequence (its first, up to rounding): no unit
    holds more; sequences not longer than this are short."""
    slice_counts: dict[int, int]
    """Global seq id -> number of units the sequence spans (1 for short sequences)."""
    unit_times_s: list[float] = field(default_factory=list)
    """Per-layer forward+backward time of each unit, in ``units`` order."""

    def balance(self) -> float:
        """Max over mean unit time (1.0 is perfect balance)."""
        if not self.unit_times_s:
            return 1.0
        return max(self.unit_times_s) / (sum(self.unit_times_s) / len(self.unit_times_s))


def make_elastic_units(lengths: Sequence[int], cost: CostModel, num_slices: int, *,
                       seqs: Sequence[int] | None = None, max_tokens_per_unit: int | None = None,
                       first_unit_id: int = 0, min_token_budget: int | None = None) -> SlicingResult:
    """Elastic units of the sequences ``seqs`` (default: all) of the batch ``lengths``.

    ``num_slices`` is the slice count of the longest of those sequences; ``max_tokens_per_unit``
    caps the tokens of any unit (raising the slice count as needed); ``min_token_budget`` lets
    units grow beyond a slice of the longest sequence.  See the module docstring.
    """
    _check_args(num_slices, max_tokens_per_unit)
    chosen = select_sequences(lengths, seqs)
    lt = LayerTime.of(cost)
    lens = {s: int(lengths[s]) for s in chosen}
    # Longest first, ties by seq id: the order every later step relies on for determinism.
    order = sorted(chosen, key=lambda s: (-lens[s], s))
    k, cuts, time_budget, token_budget = _budgets(lens[order[0]], int(num_slices), lt, max_tokens_per_unit,
                                                  min_token_budget)
    long_seqs = [s for s in order if lens[s] > token_budget]
    short_seqs = [s for s in order if lens[s] <= token_budget]
    chains = _cut_on_mesh(long_seqs, lens, cuts)
    bucket_times, members = _best_fit_buckets(chains, short_seqs, lens, lt, time_budget, token_budget)
    units, times, slice_counts = _emit(chains, bucket_times, members, short_seqs, lt, first_unit_id)
    return SlicingResult(units=units, num_slices=k, mesh=list(cuts), time_budget_s=float(time_budget),
                         token_budget=int(token_budget), slice_counts=slice_counts, unit_times_s=times)


def _check_args(num_slices, max_tokens_per_unit) -> None:
    if int(num_slices) != num_slices or num_slices < 1:
        raise ValueError(f"num_slices must be a positive integer, got {num_slices!r}")
    if max_tokens_per_unit is not None and (int(max_tokens_per_unit) != max_tokens_per_unit
                                            or max_tokens_per_unit < 1):
        raise ValueError(f"max_tokens_per_unit must be a positive integer or None, got "
                         f"{max_tokens_per_unit!r}")


def _budgets(longest: int, num_slices: int, lt: LayerTime, max_tokens: int | None,
             min_token_budget: int | None) -> tuple[int, list[int], float, int]:
    """Step 1: slice count, mesh, time budget and token budget."""
    k, cuts = mesh_for(longest, num_slices, lt, max_tokens)
    bounds = [0] + cuts + [longest]
    slice_times = [lt.b + lt.segment(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    time_budget = max(slice_times)
    token_budget = largest_slice(longest, cuts)
    assert max_tokens is None or token_budget <= max_tokens
    if min_token_budget is not None and min_token_budget > token_budget:
        # Units may be larger than a slice of the longest sequence: packing many short sequences
        # into fewer, bigger units runs the GPU better when slices would be small.
        if max_tokens is not None:
            min_token_budget = min(min_token_budget, max_tokens)
        token_budget = int(min_token_budget)
        time_budget = max(time_budget, lt.b + lt.segment(0, token_budget))
    return k, cuts, time_budget, token_budget


def _cut_on_mesh(long_seqs: list[int], lens: dict[int, int], cuts: list[int]) -> list[tuple[int, list[Segment]]]:
    """Step 2: each long sequence cut at the mesh positions inside it, as ``(seq, segments)``,
    tail last; most slices first, then longer first, then seq id."""
    chains: list[tuple[int, list[Segment]]] = []
    for s in long_seqs:
        n = lens[s]
        m = bisect.bisect_left(cuts, n)  # cuts strictly inside [0, n)
        pos = [0] + cuts[:m] + [n]
        chains.append((s, [Segment(s, pos[i], pos[i + 1]) for i in range(m + 1)]))
    chains.sort(key=lambda c: (-len(c[1]), -lens[c[0]], c[0]))
    return chains


def _best_fit_buckets(chains, short_seqs: list[int], lens: dict[int, int], lt: LayerTime,
                      time_budget: float, token_budget: int) -> tuple[list[float], list[list[Segment]]]:
    """Step 3: short sequences into tail-seeded buckets (best fit under both budgets).

    Returns each bucket's time and its short members, tail buckets first (in ``chains`` order),
    then the packed buckets in creation order.  Vectorised over buckets with numpy."""
    n_tails = len(chains)
    capacity = n_tails + len(short_seqs)
    b_time = np.empty(capacity, dtype=np.float64)
    b_tok = np.empty(capacity, dtype=np.int64)
    members: list[list[Segment]] = []
    for i, (_, segs) in enumerate(chains):
        tail = segs[-1]
        b_time[i] = lt.b + lt.segment(tail.start, tail.end)
        b_tok[i] = tail.length
        members.append([])
    n_open = n_tails
    # Slack arrays: a bucket fits a sequence when both slacks cover it.
    t_slack = np.full(capacity, -1.0)
    k_slack = np.full(capacity, -1, dtype=np.int64)
    t_slack[:n_tails] = time_budget * (1 + _REL_EPS) - b_time[:n_tails]
    k_slack[:n_tails] = token_budget - b_tok[:n_tails]
    score = np.empty(capacity)
    for s in short_seqs:
        n = lens[s]
        dt = lt.segment(0, n)
        # Best fit: the bucket left with the least time slack (first such on ties).
        i = -1
        if n_open:
            ts, sc = t_slack[:n_open], score[:n_open]
            sc.fill(np.inf)
            np.copyto(sc, ts, where=(ts >= dt) & (k_slack[:n_open] >= n))
            i = int(sc.argmin())
            if sc[i] == np.inf:
                i = -1
        if i < 0:
            i = n_open
            n_open += 1
            b_time[i] = lt.b
            b_tok[i] = 0
            t_slack[i] = time_budget * (1 + _REL_EPS) - lt.b
            k_slack[i] = token_budget
            members.append([])
        b_time[i] += dt
        b_tok[i] += n
        t_slack[i] -= dt
        k_slack[i] -= n
        members[i].append(Segment(s, 0, n))
    return [float(b_time[i]) for i in range(n_open)], members


def _emit(chains, bucket_times: list[float], members: list[list[Segment]], short_seqs: list[int],
          lt: LayerTime, first_unit_id: int) -> tuple[list[Unit], list[float], dict[int, int]]:
    """Units in EPP forward order (chains, each with its tail bucket, then packed buckets), their
    times and every sequence's slice count."""
    seg_lists: list[list[Segment]] = []
    times: list[float] = []
    slice_counts: dict[int, int] = {}
    for i, (s, segs) in enumerate(chains):
        slice_counts[s] = len(segs)
        for seg in segs[:-1]:
            seg_lists.append([seg])
            times.append(lt.b + lt.segment(seg.start, seg.end))
        seg_lists.append([segs[-1]] + members[i])
        times.append(bucket_times[i])
    for i in range(len(chains), len(bucket_times)):
        seg_lists.append(members[i])
        times.append(bucket_times[i])
    for s in short_seqs:
        slice_counts[s] = 1
    units = [Unit(first_unit_id + j, tuple(segs)) for j, segs in enumerate(seg_lists)]
    return units, times, slice_counts
