"""The longest single sequence a schedule can train under a cost model (binary search).

For each schedule the search builds the *leanest* plan it could choose for a batch of one
sequence of ``n`` tokens -- every layer checkpointed and as many slices as its grid allows -- and
asks the simulator whether it fits the memory budget; feasibility is monotone in ``n`` for these
plans, so a doubling phase and a bisection find the limit with about ``2 log2(limit)`` plans:

- ``epp``: the longest sequence cut into ``min(max_slices, n // (MIN_SLICE_TOKENS * sp))``
  equal-time slices (at least ``MIN_SLICE_TOKENS`` tokens per GPU each);
- ``seq1f1b``: the largest uniform slice count of its grid whose slices keep that many tokens;
- ``packed-1f1b`` and ``gpipe``: the sequence as one micro-batch (they never cut a sequence).

Everything is per GPU (``CostModel`` with ``sp_degree`` and ``shard``), so the limit grows with
the SP degree as activations and the K/V store are spread over more GPUs.  Trade-off: a single
sequence is the best case (a real batch shares the stage with other units), which is what a
"largest trainable length" means.
"""
from __future__ import annotations

from infinipipe_hf.planner.cost.model import CostModel

SEARCH_CAP = 1 << 24
"""No search goes beyond 16M tokens."""


def _leanest_plan(cost: CostModel, schedule: str, n: int, max_slices: int):
    from infinipipe_hf.planner.schedules import candidates  # lazy: candidates -> api -> this module for its error messages
    from infinipipe_hf.planner.batch.uniform import SLICE_COUNTS

    min_tokens = candidates.MIN_SLICE_TOKENS * cost.sp_degree
    if schedule == "epp":
        k = min(max_slices, max(1, n // min_tokens))
        staged = candidates.epp_units([n], [[0]], cost, k, None, None)
        return candidates.epp_plan([n], [[0]], cost, k, None, staged, "full", 1.0)
    if schedule == "seq1f1b":
        k = max(k for k in SLICE_COUNTS if k <= max_slices and (k == 1 or n // k >= min_tokens))
        return candidates.baseline_plan([n], [[0]], cost, schedule, n, k, "full")
    if schedule in ("packed-1f1b", "gpipe"):
        return candidates.baseline_plan([n], [[0]], cost, schedule, n, 1, "full")
    raise AssertionError(schedule)


def largest_trainable_length(cost: CostModel, max_slices: int | None = None, schedule: str = "epp") -> int:
    """Longest single sequence ``schedule`` can train fully checkpointed and maximally sliced
    (0 when not even one token fits: the model states alone exceed the budget)."""
    from infinipipe_hf.planner.search import api
    from infinipipe_hf.planner.simulate.simulator import simulate

    if max_slices is None:
        max_slices = max(api.DEFAULT_SLICE_COUNTS)
    if schedule not in api.SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not known; use one of {', '.join(api.SCHEDULES)}")

    def fits(n: int) -> bool:
        try:
            plan = _leanest_plan(cost, schedule, n, max_slices)
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
