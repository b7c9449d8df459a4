"""``ulysses-zero3``: DeepSpeed-Ulysses sequence parallelism with ZeRO-3, the HF users' default.

What it models (DeepSpeed ZeRO-3 + Ulysses, or accelerate's ``ParallelismConfig(sp_size=...)``):
every GPU runs all layers; model states are sharded over all ``world_size`` GPUs
(:class:`~.flat_cost.Zero3States`); the GPUs form ``world_size / sp`` equal SP groups; the batch is
packed (first-fit decreasing, never cutting a document) into micro-batches of at most
``pack_tokens`` tokens, each padded to a multiple of ``sp``; the groups run the micro-batches in
lockstep rounds; one uniform checkpoint count for the step.

Knobs, tuned per batch or fixed for a run (:mod:`infinipipe_hf.planner.search.static_alternative`):
``sp_degree`` (powers of two dividing the world, at most one attention head per GPU; uneven heads
are allowed, the busiest GPU pays ``ceil(H / sp)`` heads) and ``pack_tokens`` (the pipeline
baselines' packing grid, ``max(longest, 2^k)`` from 1K tokens per GPU to the whole batch).

Trade-off: packing balances tokens, not time (what users' packers do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from infinipipe_hf.planner.alternatives.equal_groups import (
    EqualGroupSchedule,
    GridContext,
    check_sizes,
    equal_group_plan,
)
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import RoundPlan
from infinipipe_hf.planner.alternatives.round_schedule import resolve_checkpointing
from infinipipe_hf.planner.batch.uniform import pack_sequences
from infinipipe_hf.planner.pipeline.grids import packing_candidates, run_pack_exponents, run_pack_knob
from infinipipe_hf.planner.schedules.base import Knobs

NAME = "ulysses-zero3"
ATTENTION = "ulysses"


@dataclass(frozen=True)
class UlyssesKnobs(Knobs):
    sp_degree: int
    pack_tokens: int

    def record(self) -> dict:
        return {"sp_degree": self.sp_degree, "pack_tokens": self.pack_tokens}


def knob_grid(lengths: Sequence[int], cost: FlatCost, sp_degrees: Sequence[int] | None = None) -> list[UlyssesKnobs]:
    """Every (SP degree, packing length) setting searched for this batch."""
    sizes = check_sizes("sp_degree", sp_degrees, cost.group_sizes(ATTENTION))
    return [UlyssesKnobs(sp, pack) for sp in sizes for pack in packing_candidates(lengths, sp)]


class UlyssesBuilder:
    """Builds plans for knob settings of one batch, caching the packing (it ignores ``sp``)."""

    def __init__(self, lengths: Sequence[int], cost: FlatCost):
        self.lengths = list(lengths)
        self.cost = cost
        self._bins: dict[int, list[list[int]]] = {}

    def __call__(self, knobs: UlyssesKnobs, checkpoint: int | None) -> RoundPlan:
        sp, pack = int(knobs.sp_degree), int(knobs.pack_tokens)
        if pack not in self._bins:
            self._bins[pack] = pack_sequences(self.lengths, pack)
        return equal_group_plan(NAME, self.lengths, self.cost, ATTENTION, sp, self._bins[pack], checkpoint,
                                {"sp_degree": sp, "pack_tokens": pack})


class UlyssesZero3Schedule(EqualGroupSchedule):
    name = NAME
    attention = ATTENTION

    def context(self, lengths: list[int], cost: FlatCost, checkpointing: str | int = "adaptive", *,
                sp_degrees: Sequence[int] | None = None, pack_tokens: Sequence[int] | None = None) -> GridContext:
        """``sp_degrees`` / ``pack_tokens`` restrict the grid."""
        cost = cost.for_system(self.name)
        grid = knob_grid(lengths, cost, sp_degrees)
        if pack_tokens:
            longest = max(lengths)
            packs = sorted({max(longest, int(p)) for p in pack_tokens})
            sizes = sorted({k.sp_degree for k in grid})
            grid = [UlyssesKnobs(sp, p) for sp in sizes for p in packs]
        sizes = sorted({k.sp_degree for k in grid})
        fixed = resolve_checkpointing(checkpointing, cost.spec.num_layers)
        return GridContext(lengths, cost, fixed, sizes, tuple(grid))

    def builder(self, lengths: Sequence[int], cost: FlatCost) -> UlyssesBuilder:
        return UlyssesBuilder(lengths, cost)

    def static_grid(self, batches, cost):
        cost = cost.for_system(self.name)
        builders = [UlyssesBuilder(b, cost) for b in batches]  # each caches its packings

        def make(sp, e):
            return lambda i, c: builders[i](UlyssesKnobs(sp, max(max(batches[i]), 1 << e)), c)
        return [({"sp_degree": sp, "pack_log2": e, "pack_tokens": run_pack_knob(e, batches)}, make(sp, e))
                for sp in cost.group_sizes(ATTENTION) for e in run_pack_exponents(batches, sp)]
