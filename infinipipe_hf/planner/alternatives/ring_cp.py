"""``ring-cp``: FSDP2 with ring-attention context parallelism (accelerate ``cp_size``, torchtitan).

What it models: every GPU runs all layers with FSDP2 sharding states over all GPUs
(:class:`~.flat_cost.Zero3States`); the GPUs form ``world_size / cp`` equal CP groups; torch's
context parallelism supports causal SDPA only, so documents are never packed together: every
micro-batch is one sequence, padded to a multiple of ``2 * cp`` for the load-balanced zigzag
split (:class:`~.flat_cost.RingGroup`); the groups run the micro-batches in lockstep rounds; one
uniform checkpoint count for the step.  Knob: ``cp_degree`` (powers of two dividing the world),
tuned per batch or fixed for a run.

Trade-off: with one sequence per micro-batch, a batch of many short documents pays the ZeRO-3
gathers once per document round; that is the system's real cost, not a modelling artefact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from infinipipe_hf.planner.alternatives.equal_groups import (
    Builder,
    EqualGroupSchedule,
    GridContext,
    check_sizes,
    equal_group_plan,
)
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import RoundPlan
from infinipipe_hf.planner.alternatives.round_schedule import resolve_checkpointing
from infinipipe_hf.planner.schedules.base import Knobs

NAME = "ring-cp"
ATTENTION = "ring"


@dataclass(frozen=True)
class RingKnobs(Knobs):
    cp_degree: int

    def record(self) -> dict:
        return {"cp_degree": self.cp_degree}


def knob_grid(lengths: Sequence[int], cost: FlatCost, cp_degrees: Sequence[int] | None = None) -> list[RingKnobs]:
    return [RingKnobs(cp) for cp in check_sizes("cp_degree", cp_degrees, cost.group_sizes(ATTENTION))]


def build_ring_cp(lengths: Sequence[int], cost: FlatCost) -> Builder:
    """``build(knobs, checkpoint)`` of one batch: one sequence per micro-batch."""
    singles = [[s] for s in range(len(lengths))]

    def build(knobs: RingKnobs, checkpoint: int | None) -> RoundPlan:
        cp = int(knobs.cp_degree)
        return equal_group_plan(NAME, lengths, cost, ATTENTION, cp, singles, checkpoint, {"cp_degree": cp})
    return build


class RingCPSchedule(EqualGroupSchedule):
    name = NAME
    attention = ATTENTION

    def context(self, lengths: list[int], cost: FlatCost, checkpointing: str | int = "adaptive", *,
                cp_degrees: Sequence[int] | None = None) -> GridContext:
        """``cp_degrees`` restricts the CP degrees searched."""
        cost = cost.for_system(self.name)
        grid = knob_grid(lengths, cost, cp_degrees)
        fixed = resolve_checkpointing(checkpointing, cost.spec.num_layers)
        return GridContext(lengths, cost, fixed, [k.cp_degree for k in grid], tuple(grid))

    def builder(self, lengths: Sequence[int], cost: FlatCost) -> Builder:
        return build_ring_cp(lengths, cost)

    def static_grid(self, batches, cost):
        cost = cost.for_system(self.name)
        builders = [build_ring_cp(b, cost) for b in batches]

        def make(cp):
            return lambda i, c: builders[i](RingKnobs(cp), c)
        return [({"cp_degree": cp}, make(cp)) for cp in cost.group_sizes(ATTENTION)]
