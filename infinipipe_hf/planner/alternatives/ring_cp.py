"""``ring-cp``: FSDP2 with ring-attention context parallelism (accelerate ``cp_size``, torchtitan).

What it models: every GPU runs all layers with FSDP2 sharding states over all GPUs (torchtitan
shards over its flattened ``dp_shard x cp`` mesh; :class:`~.flat_cost.Zero3States`); the GPUs form
``world_size / cp`` equal CP groups; torch's context parallelism supports causal SDPA only, so
documents are never packed together: every micro-batch is one sequence, padded to a multiple of
``2 * cp`` for the load-balanced zigzag split (:class:`~.flat_cost.RingGroup`); the groups run the
micro-batches in lockstep rounds; one uniform checkpoint count for the step.

Knobs, tuned per batch (:func:`plan_ring_cp`) or fixed for a run (:mod:`.static`): ``cp_degree``
(powers of two dividing the world) and the least uniform checkpointing that fits.

Trade-off: with one sequence per micro-batch, a batch of many short documents pays the ZeRO-3
gathers once per document round; that is the system's real cost, not a modelling artefact.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import AlternativeResult, RoundPlan
from infinipipe_hf.planner.alternatives.search import check_sizes, equal_group_plan, longest_fit_hint, tune

NAME = "ring-cp"
ATTENTION = "ring"


def knob_grid(lengths: Sequence[int], cost: FlatCost, cp_degrees: Sequence[int] | None = None) -> list[dict]:
    return [{"cp_degree": cp} for cp in check_sizes("cp_degree", cp_degrees, cost.group_sizes(ATTENTION))]


def build_ring_cp(lengths: Sequence[int], cost: FlatCost):
    """``build(knobs, checkpoint)`` for :func:`~.search.tune`: one sequence per micro-batch."""
    singles = [[s] for s in range(len(lengths))]

    def build(knobs: dict, checkpoint: int | None) -> RoundPlan:
        cp = int(knobs["cp_degree"])
        return equal_group_plan(NAME, lengths, cost, ATTENTION, cp, singles, checkpoint, {"cp_degree": cp})
    return build


def plan_ring_cp(lengths: Sequence[int], cost: FlatCost, *, checkpointing: str | int = "adaptive",
                 cp_degrees: Sequence[int] | None = None) -> AlternativeResult:
    """The fastest ``ring-cp`` plan of one batch over its CP degrees (``cp_degrees`` restricts them)."""
    grid = knob_grid(lengths, cost, cp_degrees)
    return tune(NAME, list(lengths), cost, grid, build_ring_cp(list(lengths), cost), checkpointing,
                longest_fit_hint(NAME, lengths, cost, ATTENTION, [k["cp_degree"] for k in grid]))
