"""Sequence processor: elastic units from one batch of lengths (InfiniPipe Alg. 1, docs/algorithms.md).

Design.  Every decision uses the per-layer forward+backward time of the cost model,
``t = a1 * sum(s^2 + 2 C s) + a2 * sum(s) + b``:

1. The longest sequence ``L`` is cut into ``K`` slices of equal time.  The cumulative time of
   ``[0, x)`` without the per-unit constant is ``a1 x^2 + a2 x``, so cut ``j`` is the root of
   ``a1 x^2 + a2 x = (j / K) (a1 L^2 + a2 L)`` (closed form; ``b`` cancels because every slice
   pays it once).  Later slices own a wider attention band, so they are shorter.  The rounded cuts
   are the *mesh*; the slowest rounded slice is the *time budget*; the first (longest) slice is
   the *token budget* (rounding may make a later slice one token longer; the largest counts).
   A ``max_tokens_per_unit`` cap smaller than that raises ``K`` until the largest slice fits.
2. Every sequence longer than the token budget is *long* and is cut at the same absolute mesh
   positions.  Between two cuts its slice has exactly the context and length of the longest
   sequence's slice there, so the same time; its remainder after its last cut (the *tail*) is
   shorter than the mesh interval it lies in, so it is cheaper.  Everything else is *short*.
3. Each tail seeds a bucket; short sequences, longest first, go to the fullest bucket that still
   fits both budgets after adding them (best fit; a tail's band cost, with its context, counts).
   When none fits, a new bucket opens.  A bucket with a tail becomes a hybrid unit, the others
   packed units.  Tails never share a bucket, so a unit never holds two last slices.  (The paper
   orders buckets by time per token; under best fit that order only breaks exact ties, so
   ties go to the earliest bucket and packed units keep their creation order, which puts the
   lightest leftovers last, where a pipeline's drain is on the critical path.)

Trade-off: one mesh for the whole batch (the paper's choice) keeps slices of different long
sequences identical in shape and the schedule simple, at the price of tails of arbitrary size;
packing short sequences into those tails recovers most of the lost balance.  The token budget,
not the time budget, is what usually binds packed units of many short sequences (they carry
little attention), so such units are lighter than a slice: ``balance()`` reports the spread.

Packing is vectorised over buckets with numpy (one pass per short sequence): a 512-sequence
batch takes a few milliseconds, so the planner can afford to try several ``K`` per batch.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.ir.units import Segment, Unit

# Relative slack on budget comparisons: times are sums of floats, budgets come from the same sums.
_REL_EPS = 1e-9


@dataclass(frozen=True)
class LayerTime:
    """Per-decoder-layer forward+backward time coefficients of a cost model."""

    a1: float  # seconds per attention pair (s^2 + 2 C s)
    a2: float  # seconds per token
    b: float  # seconds per unit (launch overhead, small-GEMM under-use)

    @staticmethod
    def of(cost: CostModel) -> "LayerTime":
        f, w = cost.layer_fwd, cost.layer_bwd
        return LayerTime(f.attn_pair_s + w.attn_pair_s, f.token_s + w.token_s, f.fixed_s + w.fixed_s)

    def segment(self, start: int, end: int) -> float:
        """Time of a segment without the per-unit constant ``b``."""
        n = end - start
        return self.a1 * (n * n + 2 * start * n) + self.a2 * n

    def unit(self, segments: Sequence[Segment]) -> float:
        return self.b + sum(self.segment(s.start, s.end) for s in segments)


def select_sequences(lengths: Sequence[int], seqs: Sequence[int] | None) -> list[int]:
    """Validated sequence ids to process (all of ``lengths`` when ``seqs`` is None)."""
    n = len(lengths)
    if seqs is None:
        chosen = list(range(n))
    else:
        chosen = [int(s) for s in seqs]
        bad = [s for s in chosen if not 0 <= s < n]
        if bad:
            raise ValueError(f"seqs contains ids {bad[:5]} outside the batch of {n} sequences; "
                             f"pass ids in 0..{n - 1}")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"seqs contains duplicate ids ({len(chosen)} given, {len(set(chosen))} "
                             f"distinct); give every sequence once")
    if not chosen:
        raise ValueError("no sequences to process (empty batch or empty seqs); give at least one")
    short = [s for s in chosen if int(lengths[s]) < 1]
    if short:
        raise ValueError(f"sequence {short[0]} has length {lengths[short[0]]}; every sequence needs "
                         f"at least 1 token (drop empty documents before planning)")
    return chosen


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


def largest_slice(length: int, cuts: Sequence[int]) -> int:
    """Tokens of the largest slice: the first, up to one token of rounding."""
    if not cuts:
        return length
    return int(np.diff(np.asarray([0, *cuts, length])).max())


def _mesh_for(longest: int, num_slices: int, lt: LayerTime, max_tokens: int | None) -> tuple[int, list[int]]:
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


def make_elastic_units(lengths: Sequence[int], cost: CostModel, num_slices: int, *,
                       seqs: Sequence[int] | None = None, max_tokens_per_unit: int | None = None,
                       first_unit_id: int = 0, min_token_budget: int | None = None) -> SlicingResult:
    """Elastic units of the sequences ``seqs`` (default: all) of the batch ``lengths``.

    ``num_slices`` is the slice count of the longest of those sequences; ``max_tokens_per_unit``
    caps the tokens of any unit (raising the slice count as needed).  See the module docstring.
    """
    if int(num_slices) != num_slices or num_slices < 1:
        raise ValueError(f"num_slices must be a positive integer, got {num_slices!r}")
    if max_tokens_per_unit is not None and (int(max_tokens_per_unit) != max_tokens_per_unit
                                            or max_tokens_per_unit < 1):
        raise ValueError(f"max_tokens_per_unit must be a positive integer or None, got "
                         f"{max_tokens_per_unit!r}")
    chosen = select_sequences(lengths, seqs)
    lt = LayerTime.of(cost)
    lens = {s: int(lengths[s]) for s in chosen}
    # Longest first, ties by seq id: the order every later step relies on for determinism.
    order = sorted(chosen, key=lambda s: (-lens[s], s))
    longest = lens[order[0]]
    k, cuts = _mesh_for(longest, int(num_slices), lt, max_tokens_per_unit)
    bounds = [0] + cuts + [longest]
    slice_times = [lt.b + lt.segment(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    time_budget = max(slice_times)
    token_budget = largest_slice(longest, cuts)
    assert max_tokens_per_unit is None or token_budget <= max_tokens_per_unit
    if min_token_budget is not None and min_token_budget > token_budget:
        # Units may be larger than a slice of the longest sequence: packing many short sequences
        # into fewer, bigger units runs the GPU better when slices would be small.
        if max_tokens_per_unit is not None:
            min_token_budget = min(min_token_budget, max_tokens_per_unit)
        token_budget = int(min_token_budget)
        time_budget = max(time_budget, lt.b + lt.segment(0, token_budget))

    long_seqs = [s for s in order if lens[s] > token_budget]
    short_seqs = [s for s in order if lens[s] <= token_budget]

    # --- step 2: cut long sequences on the mesh ------------------------------------------
    chains: list[tuple[int, list[Segment]]] = []  # (seq, its segments), tail last
    for s in long_seqs:
        n = lens[s]
        m = bisect.bisect_left(cuts, n)  # cuts strictly inside [0, n)
        pos = [0] + cuts[:m] + [n]
        chains.append((s, [Segment(s, pos[i], pos[i + 1]) for i in range(m + 1)]))
    chains.sort(key=lambda c: (-len(c[1]), -lens[c[0]], c[0]))

    # --- step 3: best-fit packing of short sequences into tail-seeded buckets --------------
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

    # --- emit units in EPP forward order -------------------------------------------------
    seg_lists: list[list[Segment]] = []
    times: list[float] = []
    slice_counts: dict[int, int] = {}
    for i, (s, segs) in enumerate(chains):
        slice_counts[s] = len(segs)
        for seg in segs[:-1]:
            seg_lists.append([seg])
            times.append(lt.b + lt.segment(seg.start, seg.end))
        seg_lists.append([segs[-1]] + members[i])
        times.append(float(b_time[i]))
    # Packed buckets in creation order: by their longest member, so the lightest leftovers run
    # last, where a pipeline's drain is on the critical path.
    for i in range(n_tails, n_open):
        seg_lists.append(members[i])
        times.append(float(b_time[i]))
    for s in short_seqs:
        slice_counts[s] = 1
    units = [Unit(first_unit_id + j, tuple(segs)) for j, segs in enumerate(seg_lists)]
    return SlicingResult(units=units, num_slices=k, mesh=list(cuts), time_budget_s=float(time_budget),
                         token_budget=int(token_budget), slice_counts=slice_counts, unit_times_s=times)
