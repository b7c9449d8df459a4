"""``seq1f1b``: packed micro-batches cut into sequence slices (Seq1F1B, Sun et al. 2024; SlimPipe), 1F1B.

Knobs: the packing length, the slice count (the caller's ``num_slices``, a static setting, or the
grid of :func:`~.grids.slicing_candidates`) and the slice balance, Seq1F1B's
``--pipe-sp-strategy``: ``compute`` (its computation-wise split, the one its experiment script
runs: later slices attend to more context, so they are shorter and every slice costs about the
same layer time) or ``tokens`` (its ``average`` split, equal token counts, as SlimPipe cuts).
Both are searched: equal compute shrinks the bubble; equal tokens keeps the first slice small, so
it can fit where equal compute does not.  Warm-up as EPP's with every micro-batch's slice count:
``(pp - 1 - r) + (K - 1)`` forwards on stage ``r``.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.uniform import SLICE_BALANCES, SliceBalance, make_uniform_slices
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.actions import epp_warmup
from infinipipe_hf.planner.pipeline.grids import MIN_SLICE_TOKENS, SLICE_COUNTS, slicing_candidates
from infinipipe_hf.planner.schedules.baseline import BaselineSchedule, PackKnobs
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext
from infinipipe_hf.planner.simulate.simulator import simulate


def balances(k: int) -> tuple[SliceBalance, ...]:
    """Slice balances worth searching at ``k`` slices (one slice has nothing to balance)."""
    return SLICE_BALANCES if k > 1 else ("tokens",)


class Seq1F1BSchedule(BaselineSchedule):
    name = "seq1f1b"

    def slicings(self, ctx: PipelineContext) -> list[tuple[int, SliceBalance]]:
        if ctx.num_slices:
            counts = sorted(set(int(k) for k in ctx.num_slices))
        else:
            counts = slicing_candidates(ctx.lengths, ctx.cost.dims)
        return [(k, b) for k in counts for b in balances(k)]

    def leanest_plan(self, cost: CostModel, n: int, max_slices: int) -> Plan:
        """Every layer checkpointed, the most slices of ``MIN_SLICE_TOKENS`` per GPU, and the balance
        with the lower simulated peak memory."""
        min_tokens = MIN_SLICE_TOKENS * cost.dims.sp_degree
        k = max(k for k in SLICE_COUNTS if k <= max_slices and (k == 1 or n // k >= min_tokens))
        plans, error = [], None
        for balance in balances(k):
            try:
                plans.append(self.plan([n], [[0]], cost, PackKnobs(n, k, balance), "full"))
            except ValueError as exc:
                error = exc
        if not plans:
            raise error
        return min(plans, key=lambda p: max(simulate(p, cost).peak_memory_bytes))

    def make_units(self, lengths: Sequence[int], cost: CostModel, knobs: PackKnobs, seqs: Sequence[int],
                   first_unit_id: int) -> list[Unit]:
        return make_uniform_slices(lengths, cost, knobs.pack_tokens, knobs.num_slices or 1, seqs=seqs,
                                   first_unit_id=first_unit_id, balance=knobs.slice_balance or "tokens",
                                   min_tokens=MIN_SLICE_TOKENS * cost.dims.sp_degree)

    def warmup(self, dims: ParallelDims, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        return epp_warmup(dims, num_slices)
