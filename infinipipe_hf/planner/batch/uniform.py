"""Units for the baseline schedules, in the same ``Unit`` format as EPP (docs/algorithms.md, Baselines).

- ``packed-1f1b`` and ``gpipe`` (Megatron/DeepSpeed/torchtitan-style batch-level packing): whole
  sequences packed into micro-batches of at most ``pack_tokens`` tokens, first-fit decreasing.
  Batch-level packing never cuts a sequence, so one longer than ``pack_tokens`` gets a
  micro-batch of its own (the packing length then only governs the short ones).
- ``seq1f1b`` (Seq1F1B / SlimPipe uniform token slicing): the same micro-batches, each cut into
  ``num_slices`` slices of equal token count regardless of document boundaries: a slice may
  hold the end of one document and the start of the next, each segment carrying its context.

``cost`` is accepted by the makers for a uniform signature across schedules; the baselines'
decisions are deliberately cost-blind, which is what the systems they model do.  Their knob grids
are in :mod:`~infinipipe_hf.planner.schedules.grids`.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.planner.batch.packing import first_fit_decreasing
from infinipipe_hf.planner.batch.select import select_sequences
from infinipipe_hf.planner.cost.model import CostModel


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


def uniform_token_slices(members: Sequence[tuple[int, int]], num_slices: int) -> list[list[Segment]]:
    """Cut the concatenation of ``(seq, length)`` documents into equal-token slices.

    Slice sizes differ by at most one token (the first ``n % K`` slices get the extra one);
    ``K`` is clamped to the token count so no slice is empty.
    """
    total = sum(n for _, n in members)
    k = min(num_slices, total)
    q, r = divmod(total, k)
    slices: list[list[Segment]] = []
    doc, pos = 0, 0  # current document and offset inside it
    for j in range(k):
        need = q + (1 if j < r else 0)
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


def make_uniform_slices(lengths: Sequence[int], cost: CostModel, pack_tokens: int, num_slices: int, *,
                        seqs: Sequence[int] | None = None, first_unit_id: int = 0) -> list[Unit]:
    """seq1f1b units: packed micro-batches, each cut into ``num_slices`` equal-token slices.

    A micro-batch's slices are consecutive in the returned (forward) order.
    """
    num_slices = _check_positive("num_slices", num_slices)
    units: list[Unit] = []
    for b in pack_sequences(lengths, pack_tokens, seqs):
        for segs in uniform_token_slices([(s, int(lengths[s])) for s in b], num_slices):
            units.append(Unit(first_unit_id + len(units), tuple(segs)))
    return units
