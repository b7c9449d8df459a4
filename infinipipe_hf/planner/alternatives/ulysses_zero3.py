"""``ulysses-zero3``: DeepSpeed-Ulysses sequence parallelism with ZeRO-3, the HF users' default.

What it models (DeepSpeed ZeRO-3 + Ulysses, or accelerate's ``ParallelismConfig(sp_size=...)``):
every GPU runs all layers; parameters, gradients and optimizer states are sharded over all
``world_size`` GPUs (:class:`~.flat_cost.Zero3States`); the GPUs form ``world_size / sp`` equal SP
groups of ``sp`` GPUs; the batch is packed (batch-level packing, first-fit decreasing, never
cutting a document) into micro-batches of at most ``pack_tokens`` tokens (a longer document gets
a micro-batch of its own), each padded to a multiple of ``sp`` as Ulysses needs; the groups run
the micro-batches in lockstep rounds; one uniform checkpoint count for the step.

Knobs, tuned per batch (:func:`plan_ulysses_zero3`) or fixed for a run (:mod:`.static`):
``sp_degree`` (powers of two dividing the world, at most one attention head per GPU; uneven heads
are allowed, the busiest GPU pays ``ceil(H / sp)`` heads), ``pack_tokens`` (the packing grid of the
pipeline baselines: ``max(longest, 2^k)`` from 1K tokens per GPU to the whole batch) and the
least uniform checkpointing that fits.

Trade-off: packing balances tokens, not time (what users' packers do); the lockstep assignment of
micro-batches to groups is the best one for those micro-batches (:func:`~.search.lockstep_rounds`).
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.planner.batch.uniform import pack_sequences, packing_candidates
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import AlternativeResult, RoundPlan
from infinipipe_hf.planner.alternatives.search import check_sizes, equal_group_plan, longest_fit_hint, tune

NAME = "ulysses-zero3"
ATTENTION = "ulysses"


def knob_grid(lengths: Sequence[int], cost: FlatCost, sp_degrees: Sequence[int] | None = None) -> list[dict]:
    """Every (SP degree, packing length) setting searched for this batch."""
    sizes = check_sizes("sp_degree", sp_degrees, cost.group_sizes(ATTENTION))
    return [{"sp_degree": sp, "pack_tokens": pack} for sp in sizes for pack in packing_candidates(lengths, sp)]


class UlyssesBuilder:
    """Builds plans for knob settings of one batch, caching the packing (it ignores ``sp``)."""

    def __init__(self, lengths: Sequence[int], cost: FlatCost):
        self.lengths = list(lengths)
        self.cost = cost
        self._bins: dict[int, list[list[int]]] = {}

    def __call__(self, knobs: dict, checkpoint: int | None) -> RoundPlan:
        sp, pack = int(knobs["sp_degree"]), int(knobs["pack_tokens"])
        if pack not in self._bins:
            self._bins[pack] = pack_sequences(self.lengths, pack)
        return equal_group_plan(NAME, self.lengths, self.cost, ATTENTION, sp, self._bins[pack], checkpoint,
                                {"sp_degree": sp, "pack_tokens": pack})


def plan_ulysses_zero3(lengths: Sequence[int], cost: FlatCost, *, checkpointing: str | int = "adaptive",
                       sp_degrees: Sequence[int] | None = None, pack_tokens: Sequence[int] | None = None
                       ) -> AlternativeResult:
    """The fastest ``ulysses-zero3`` plan of one batch over its knobs (``sp_degrees`` /
    ``pack_tokens`` restrict the grid; ``checkpointing``: see :func:`~.search.tune`)."""
    grid = knob_grid(lengths, cost, sp_degrees)
    if pack_tokens:
        longest = max(lengths)
        packs = sorted({max(longest, int(p)) for p in pack_tokens})
        sizes = sorted({k["sp_degree"] for k in grid})
        grid = [{"sp_degree": sp, "pack_tokens": p} for sp in sizes for p in packs]
    sizes = sorted({k["sp_degree"] for k in grid})
    return tune(NAME, lengths, cost, grid, UlyssesBuilder(lengths, cost), checkpointing,
                longest_fit_hint(NAME, lengths, cost, ATTENTION, sizes))
