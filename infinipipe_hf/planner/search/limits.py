"""The longest single sequence a pipeline schedule can train under a cost model (binary search).

For each schedule the search builds the *leanest* plan it could choose for a batch of one
sequence of ``n`` tokens (``PipelineSchedule.leanest_plan``: every layer checkpointed and as many
slices as its grid allows; EPP's slices keep ``MIN_SLICE_TOKENS`` tokens per GPU, the packing
baselines never cut) and asks the simulator whether it fits the memory budget; feasibility is
monotone in ``n`` for these plans, so a doubling phase and a bisection find the limit with about
``2 log2(limit)`` plans.

Everything is per GPU (``CostModel`` with ``sp_degree`` and ``shard``), so the limit grows with
the SP degree as activations and the K/V store are spread over more GPUs.  Trade-off: a single
sequence is the best case (a real batch shares the stage with other units), which is what a
"largest trainable length" means.
"""
from __future__ import annotations

from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.registry import get_schedule
from infinipipe_hf.planner.schedules.base import PIPELINE
from infinipipe_hf.planner.schedules.grids import DEFAULT_SLICE_COUNTS
from infinipipe_hf.planner.simulate.simulator import simulate

SEARCH_CAP = 1 << 24
"""No search goes beyond 16M tokens."""


def largest_trainable_length(cost: CostModel, max_slices: int | None = None, schedule: str = "epp") -> int:
    """Longest single sequence ``schedule`` can train fully checkpointed and maximally sliced
    (0 when not even one token fits: the model states alone exceed the budget)."""
    if max_slices is None:
        max_slices = max(DEFAULT_SLICE_COUNTS)
    leanest = get_schedule(schedule, PIPELINE).leanest_plan

    def fits(n: int) -> bool:
        try:
            plan = leanest(cost, n, max_slices)
        except ValueError:
            return False
        return simulate(plan, cost).feasible

    lo, hi = 0, 1
    while fits(hi) and hi < SEARCH_CAP:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
