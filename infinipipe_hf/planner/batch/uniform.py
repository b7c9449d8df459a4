"""Units for the baseline schedules, in the same ``Unit`` format as EPP (docs/algorithms.md, Baselines).

- ``packed-1f1b`` and ``gpipe`` (Megatron/DeepSpeed/torchtitan-style batch-level packing): whole
  sequences packed into micro-batches of at most ``pack_tokens`` tokens, first-fit decreasing.
  Batch-level packing never cuts a sequence, so one longer than ``pack_tokens`` gets a
  micro-batch of its own (the packing length then only governs the short ones).
- ``seq1f1b`` (Seq1F1B / SlimPipe sequence slicing): the same micro-batches, each cut into
  ``num_slices`` slices regardless of document boundaries: a slice may hold the end of one
  document and the start of the next, each segment carrying its context.  Slices are of equal
  token count (``"tokens"``, SlimPipe and Seq1F1B's ``average`` split) or of equal layer time
  (``"compute"``, Seq1F1B's computation-wise split, :func:`equal_compute_slices`).

``cost`` is accepted by the makers for a uniform signature across schedules.  The baselines'
decisions are cost-blind, as in the systems they model, except where the system itself prices
its cuts: the computation-wise split balances the cost model's layer time (Seq1F1B balances its
own FLOP count).  Their knob grids are in :mod:`~infinipipe_hf.planner.pipeline.grids`.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Literal, Sequence, get_args

from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.planner.batch.packing import first_fit_decreasing
from infinipipe_hf.planner.batch.select import select_sequences
from infinipipe_hf.planner.cost.model import CostModel

SliceBalance = Literal["tokens", "compute"]
"""How seq1f1b cuts a micro-batch: slices of equal token count, or of equal layer time."""
SLICE_BALANCES: tuple[str, ...] = get_args(SliceBalance)


def _check_positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def pack_sequences(lengths: Sequence[int], pack_tokens: int, seqs: Sequence[int] | None = None) -> list[list[int]]:
    """Micro-batches (seq ids, longest first) by first-fit decreasing under ``pack_tokens``."""
    pack_tokens = _check_positive("pack_tokens", pack_tokens)
    return first_fit_decreasing(lengths, select_sequences(lengths, seqs), pack_tokens)


def make_packed_units(lengths: Sequence[int], cost: CostModel, pack_tokens: int, *,
                      seqs: Sequence[int] | None = None, first_unit_id: int = 0) -> list[Unit]:
    """One unit per packed micro-batch of whole sequences (packed-1f1b, gpipe)."""
    bins = pack_sequences(lengths, pack_tokens, seqs)
    return [Unit(first_unit_id + j, tuple(Segment(s, 0, int(lengths[s])) for s in b))
            for j, b in enumerate(bins)]


def _cut(members: Sequence[tuple[int, int]], bounds: Sequence[int]) -> list[list[Segment]]:
    """The slices ``[bounds[j], bounds[j + 1])`` of the concatenated documents, as segments."""
    slices: list[list[Segment]] = []
    doc, pos = 0, 0  # current document and offset inside it
    for a, b in zip(bounds, bounds[1:]):
        need = b - a
        segs: list[Segment] = []
        while need:
            seq, n = members[doc]
            take = min(need, n - pos)
            segs.append(Segment(seq, pos, pos + take))
            need -= take
            pos += take
            if pos == n:
                doc, pos = doc + 1, 0
        slices.append(segs)
    assert doc == len(members) and pos == 0
    return slices


def uniform_token_slices(members: Sequence[tuple[int, int]], num_slices: int) -> list[list[Segment]]:
    """Cut the concatenation of ``(seq, length)`` documents into equal-token slices.

    Slice sizes differ by at most one token (the first ``n % K`` slices get the extra one);
    ``K`` is clamped to the token count so no slice is empty.
    """
    total = sum(n for _, n in members)
    k = min(num_slices, total)
    q, r = divmod(total, k)
    bounds = [0]
    for j in range(k):
        bounds.append(bounds[-1] + q + (1 if j < r else 0))
    return _cut(members, bounds)


def _work_curve(members: Sequence[tuple[int, int]], pair_weight: float) -> Callable[[int], float]:
    """``W(x)``: layer work of the first ``x`` tokens of the concatenation, in token-equivalents
    (``x`` plus ``pair_weight`` times the causal pairs they own, :class:`UnitShape`'s ``pairs``)."""
    starts, pairs_before = [], []
    offset, pairs = 0, 0
    for _, n in members:
        starts.append(offset)
        pairs_before.append(pairs)
        offset += n
        pairs += n * n

    def work(x: int) -> float:
        d = max(0, bisect_right(starts, x) - 1)
        inside = x - starts[d]
        return x + pair_weight * (pairs_before[d] + inside * inside)
    return work


def equal_compute_slices(members: Sequence[tuple[int, int]], num_slices: int, pair_weight: float,
                         min_tokens: int = 1) -> list[list[Segment]]:
    """Cut the concatenation of ``(seq, length)`` documents into slices of near-equal layer time.

    A token at position ``p`` of its document costs ``1 + pair_weight * (2p + 1)`` token-equivalents
    (its linear work and its causal attention band), so slices late in a long document are shorter.
    Cut points are solved from the end, as Seq1F1B's partition solver does: the last slice takes
    ``1/K`` of the work, the one before ``1/(K-1)`` of the rest, and so on; each cut is the integer
    closest to its target.  Every slice keeps at least ``min_tokens`` tokens while ``K`` such slices
    fit (else ``total // K``); ``K`` is clamped to the token count so no slice is empty.
    """
    total = sum(n for _, n in members)
    k = min(num_slices, total)
    floor = min(max(1, int(min_tokens)), total // k)
    work = _work_curve(members, max(0.0, float(pair_weight)))
    bounds = [total]
    for j in range(k, 1, -1):
        end = bounds[-1]
        target = work(end) * (j - 1) / j
        lo, hi = (j - 1) * floor, end - floor  # the cut leaves j - 1 slices before it, one after
        while lo < hi:  # the first x in [lo, hi] with W(x) >= target (W increases)
            mid = (lo + hi) // 2
            if work(mid) < target:
                lo = mid + 1
            else:
                hi = mid
        if lo > (j - 1) * floor and target - work(lo - 1) < work(lo) - target:
            lo -= 1
        bounds.append(lo)
    bounds.append(0)
    return _cut(members, bounds[::-1])


def layer_pair_weight(cost: CostModel) -> float:
    """Seconds of a causal attention pair over seconds of a token, in one layer's forward and
    backward per GPU: the ``pair_weight`` of :func:`equal_compute_slices` under ``cost``."""
    fwd, bwd = cost.coefficients.layer_fwd, cost.coefficients.layer_bwd
    token_s = fwd.token_s + bwd.token_s
    pair_s = fwd.attn_pair_s + bwd.attn_pair_s
    return pair_s / token_s if token_s > 0 else 0.0


def make_uniform_slices(lengths: Sequence[int], cost: CostModel, pack_tokens: int, num_slices: int, *,
                        seqs: Sequence[int] | None = None, first_unit_id: int = 0,
                        balance: SliceBalance = "tokens", min_tokens: int = 1) -> list[Unit]:
    """seq1f1b units: packed micro-batches, each cut into ``num_slices`` slices of equal token count
    (``balance="tokens"``) or of equal layer time under ``cost`` (``"compute"``, slices of at least
    ``min_tokens`` where they fit).  A micro-batch's slices are consecutive in the returned
    (forward) order."""
    num_slices = _check_positive("num_slices", num_slices)
    if balance not in SLICE_BALANCES:
        raise ValueError(f"balance={balance!r} is not a slice balance; use one of {', '.join(SLICE_BALANCES)}")
    weight = layer_pair_weight(cost) if balance == "compute" else 0.0
    units: list[Unit] = []
    for b in pack_sequences(lengths, pack_tokens, seqs):
        members = [(s, int(lengths[s])) for s in b]
        cut = (equal_compute_slices(members, num_slices, weight, min_tokens) if balance == "compute"
               else uniform_token_slices(members, num_slices))
        for segs in cut:
            units.append(Unit(first_unit_id + len(units), tuple(segs)))
    return units
