"""``ring-cp-packed``: ring-attention context parallelism on packed variable-length (THD) batches.

What it models (Megatron-LM / Transformer Engine context parallelism with ``qkv_format="thd"``):
the same FSDP2 states and ring as ``ring-cp`` (:class:`~.flat_cost.PackedRingGroup`), but documents
are packed into micro-batches of at most ``pack_tokens`` tokens (first-fit decreasing, never
cutting a document) and each document attends only to itself, so a micro-batch costs the sum of
its documents' causal squares.  Knobs: ``cp_degree`` and ``pack_tokens`` (the packing grid of
``ulysses-zero3``), tuned per batch or fixed for a run.

Trade-off: packing removes ``ring-cp``'s one-round-per-document cost on batches of short documents;
each document is padded to the zigzag split only as a whole micro-batch is (a simplification of at
most ``2 * cp - 1`` tokens per document).
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

NAME = "ring-cp-packed"
ATTENTION = "ring-packed"


@dataclass(frozen=True)
class PackedRingKnobs(Knobs):
    cp_degree: int
    pack_tokens: int

    def record(self) -> dict:
        return {"cp_degree": self.cp_degree, "pack_tokens": self.pack_tokens}


class PackedRingBuilder:
    """Builds plans for knob settings of one batch, caching the packing (it ignores ``cp``)."""

    def __init__(self, lengths: Sequence[int], cost: FlatCost):
        self.lengths = list(lengths)
        self.cost = cost
        self._bins: dict[int, list[list[int]]] = {}

    def __call__(self, knobs: PackedRingKnobs, checkpoint: int | None) -> RoundPlan:
        cp, pack = int(knobs.cp_degree), int(knobs.pack_tokens)
        if pack not in self._bins:
            self._bins[pack] = pack_sequences(self.lengths, pack)
        return equal_group_plan(NAME, self.lengths, self.cost, ATTENTION, cp, self._bins[pack], checkpoint,
                                {"cp_degree": cp, "pack_tokens": pack})


class PackedRingCPSchedule(EqualGroupSchedule):
    name = NAME
    attention = ATTENTION

    def context(self, lengths: list[int], cost: FlatCost, checkpointing: str | int = "adaptive", *,
                cp_degrees: Sequence[int] | None = None, pack_tokens: Sequence[int] | None = None) -> GridContext:
        """``cp_degrees`` / ``pack_tokens`` restrict the grid."""
        cost = cost.for_system(self.name)
        sizes = check_sizes("cp_degree", cp_degrees, cost.group_sizes(ATTENTION))
        if pack_tokens:
            longest = max(lengths)
            grid = [PackedRingKnobs(cp, p) for cp in sizes for p in sorted({max(longest, int(p)) for p in pack_tokens})]
        else:
            grid = [PackedRingKnobs(cp, p) for cp in sizes for p in packing_candidates(lengths, cp)]
        fixed = resolve_checkpointing(checkpointing, cost.spec.num_layers)
        return GridContext(lengths, cost, fixed, sizes, tuple(grid))

    def builder(self, lengths: Sequence[int], cost: FlatCost) -> PackedRingBuilder:
        return PackedRingBuilder(lengths, cost)

    def static_grid(self, batches, cost):
        cost = cost.for_system(self.name)
        builders = [PackedRingBuilder(b, cost) for b in batches]

        def make(cp, e):
            return lambda i, c: builders[i](PackedRingKnobs(cp, max(max(batches[i]), 1 << e)), c)
        return [({"cp_degree": cp, "pack_log2": e, "pack_tokens": run_pack_knob(e, batches)}, make(cp, e))
                for cp in cost.group_sizes(ATTENTION) for e in run_pack_exponents(batches, cp)]
