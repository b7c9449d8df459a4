"""Knob grids the pipeline schedules are tuned over, per batch and per run.

EPP searches the slice count of the longest sequence (``DEFAULT_SLICE_COUNTS``) and, when every
sequence is short, a unit token floor; the baselines search a packing length ``max(longest, 2^k)``
and, for seq1f1b, a slice count per micro-batch (``SLICE_COUNTS``).  Slices keep at least
``MIN_SLICE_TOKENS`` tokens per GPU: thinner slices run the GPU badly.  Trade-off: grids are
powers of two (a few candidates, milliseconds each) rather than a fine sweep.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.select import select_sequences

DEFAULT_SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Slice counts of the longest sequence EPP searches."""
SLICE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""Slice counts per micro-batch seq1f1b searches."""
MIN_SLICE_TOKENS = 256
"""Fewest tokens per GPU in a slice searched (thinner slices run the GPU badly)."""
MIN_PACK_LOG2 = 10
"""Smallest packing length searched: 1K tokens."""


def slice_count_candidates(lengths: Sequence[int], num_slices: Sequence[int] | None,
                           dims: ParallelDims) -> list[int]:
    """EPP's slice counts: the caller's, or the default grid while slices keep enough tokens per
    GPU of a stage of ``dims``."""
    if num_slices:
        return sorted(set(int(k) for k in num_slices))
    longest = max(lengths)
    ks = [k for k in DEFAULT_SLICE_COUNTS if k == 1 or longest / k >= MIN_SLICE_TOKENS * dims.sp_degree]
    return ks


def token_floor_candidates(lengths: Sequence[int], dims: ParallelDims) -> list[int | None]:
    """Unit token floors tried next to the slice mesh: packing short sequences into units larger than
    the longest sequence's slice pays off when every sequence is short (few, efficient units).
    A stage of ``sp_degree`` GPUs runs a unit ``sp_degree`` times longer as efficiently."""
    longest, sp_degree = max(lengths), dims.sp_degree
    return [None] + [p * sp_degree for p in (4096, 8192, 16384) if longest < p * sp_degree < sum(lengths)]


ROUND_COUNTS = tuple(range(1, 9))
"""Rounds per replica whose unit token floors EPP also tries with SP rounds: a few rounds of
equal single-GPU units, each rank's share of the batch split evenly, is how FlexSP runs a batch
of short sequences, and the best round count moves with the memory budget."""


def round_count_floors(lengths: Sequence[int], replicas: Sequence[Sequence[int]], dims: ParallelDims,
                       rank_cap: int | None = None) -> list[int]:
    """Unit token floors (whole-group tokens) for about ``R`` rounds of single-GPU units of the
    fullest replica's tokens, for each ``R`` of :data:`ROUND_COUNTS` whose even split of the
    replica over the stage's ``sp_degree`` ranks holds the longest sequence: that split, and the
    split plus the longest sequence per rank, with which any packing of the sequences fits in
    ``R`` rounds (a unit that cannot take the next sequence already holds more than the split).

    ``rank_cap``: the most tokens a single-GPU unit holds in memory.  The fewest rounds it allows
    (and one more) are tried too, and where the cap falls between a split and the split plus the
    longest sequence it is a floor too: units as full as memory allows, as FlexSP runs the fewest
    rounds that fit, balanced under that cap."""
    most = max(sum(int(lengths[s]) for s in seqs) for seqs in replicas)
    sp_degree, longest = dims.sp_degree, max(lengths)
    counts = list(ROUND_COUNTS)
    if rank_cap:
        fewest = -(-most // (sp_degree * rank_cap))
        counts += [r for r in (fewest, fewest + 1) if r not in counts]
    per_rank = []
    for e in [-(-most // (sp_degree * r)) for r in counts]:
        if e >= longest:
            per_rank += [e, e + longest]
            if rank_cap and e < rank_cap < e + longest:
                per_rank.append(rank_cap)
    return list(dict.fromkeys(p * sp_degree for p in per_rank))


def packing_candidates(lengths: Sequence[int], group_size: int = 1) -> list[int]:
    """Packing lengths searched for the packing baselines: ``max(longest, 2^k)``, increasing.

    ``k`` runs from 10 (1K tokens) to the largest power of two not above the batch's total, so
    the grid spans "one sequence per micro-batch" to "about two micro-batches per step".  With
    ``group_size`` GPUs sharing each micro-batch (a stage's SP group, or the Ulysses / ring group
    of a non-pipeline alternative) the grid starts at the first power of two of at least 1K tokens
    per GPU (smaller micro-batches only waste the GPUs).
    """
    chosen = select_sequences(lengths, None)
    longest = max(int(lengths[s]) for s in chosen)
    total = sum(int(lengths[s]) for s in chosen)
    low = MIN_PACK_LOG2 + (int(group_size) - 1).bit_length()
    top = max(low, total.bit_length() - 1)
    return sorted({max(longest, 1 << k) for k in range(low, top + 1)})


def slicing_candidates(lengths: Sequence[int], dims: ParallelDims, pack_tokens: int | None = None) -> list[int]:
    """Slice counts per micro-batch searched for seq1f1b: 1, 2, 4, ... while equal-token slices keep
    ``MIN_SLICE_TOKENS`` tokens per GPU (a stage's ``sp_degree`` GPUs share each slice).

    The slice size is judged on ``pack_tokens`` (default: the longest sequence, the smallest
    packing length searched).
    """
    chosen = select_sequences(lengths, None)
    base = int(pack_tokens) if pack_tokens is not None else max(int(lengths[s]) for s in chosen)
    return [k for k in SLICE_COUNTS if k == 1 or base // k >= MIN_SLICE_TOKENS * dims.sp_degree]


def run_pack_exponents(batches: Sequence[Sequence[int]], group_size: int) -> range:
    """Packing lengths ``2^e`` a static setting over a run may use: from 1K tokens per GPU of a
    group of ``group_size`` GPUs sharing each micro-batch (as :func:`packing_candidates`) to the
    smallest batch's total."""
    low = MIN_PACK_LOG2 + (int(group_size) - 1).bit_length()
    top = min(sum(b).bit_length() - 1 for b in batches)
    return range(low, max(low, top) + 1)


def run_pack_knob(e: int, batches: Sequence[Sequence[int]]) -> int | str:
    """The packing length a setting ``2^e`` amounts to: ``"longest"`` when every batch packs at
    its longest sequence (``2^e`` at most the shortest of the batches' longest)."""
    return "longest" if (1 << e) <= min(max(b) for b in batches) else 1 << e
