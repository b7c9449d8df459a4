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

from infinipipe_hf.layout import ParallelDims, sharding_over
from infinipipe_hf.planner.cost.activations import largest_fitting
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.grids import DEFAULT_SLICE_COUNTS
from infinipipe_hf.planner.registry import get_schedule
from infinipipe_hf.planner.schedules.base import PIPELINE
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

    return largest_fitting(fits, SEARCH_CAP - 1)


def states_per_gpu(cost: CostModel) -> float:
    """Model states (weights, gradients, optimizer states) per GPU on the fullest stage."""
    return max(cost.acts.static_bytes(s) for s in range(cost.dims.pp_degree))


def _first_fit(cost: CostModel, layouts) -> tuple[ParallelDims, float] | None:
    """The first of ``layouts`` (keyword dicts of :class:`ParallelDims`) whose states fit ``cost``'s budget."""
    for kw in layouts:
        try:
            dims = ParallelDims(**kw, gpus_per_node=cost.dims.gpus_per_node)
            other = CostModel(cost.spec, cost.profile, dims, memory_budget_bytes=cost.memory_budget_bytes,
                              state_precision=cost.states.precision)
        except ValueError:
            continue  # a layout the checks refuse (heads, shard groups)
        states = states_per_gpu(other)
        if states < cost.memory_budget_bytes:
            return dims, states
    return None


def states_fit_options(cost: CostModel, max_gpus: int = 4096) -> list[str]:
    """The fewest GPUs that bring the model states per GPU under ``cost``'s budget, one option per
    direction from ``cost``'s layout: more stages, states sharded over a larger SP group, states
    sharded over DP replicas (FSDP2).  Activations still need room beside the states."""
    now = cost.dims
    pp, sp, dp, shard = now.pp_degree, now.sp_degree, now.dp_degree, now.shard
    powers = [2**k for k in range(1, max_gpus.bit_length())]
    sp_mode = sharding_over({*shard.shard_dims, "sp"})  # keeps any sharding over DP
    dp_mode = sharding_over({*shard.shard_dims, "dp"})
    directions = (
        ("pp_degree={pp}", [dict(pp_degree=p, sp_degree=sp, dp_degree=dp, shard=shard)
                            for p in range(pp + 1, cost.spec.num_layers + 1) if p * sp * dp <= max_gpus]),
        ("shard='{shard}' with sp_degree={sp}", [
            dict(pp_degree=pp, sp_degree=s, dp_degree=dp, shard=sp_mode) for s in powers
            if s > sp and s <= min(cost.spec.num_attention_heads, now.gpus_per_node) and pp * s * dp <= max_gpus]),
        ("shard='{shard}' over dp_degree={dp} replicas", [
            dict(pp_degree=pp, sp_degree=sp, dp_degree=d, shard=dp_mode) for d in powers
            if d > (dp if "dp" in shard.shard_dims else 1) and pp * sp * d <= max_gpus]),
    )
    out = []
    for text, layouts in directions:
        found = _first_fit(cost, layouts)
        if found is not None:
            fit, states = found
            out.append(f"{text.format(pp=fit.pp_degree, sp=fit.sp_degree, dp=fit.dp_degree, shard=fit.shard.name)} "
                       f"({fit.world_size} GPUs, {states / 2**30:.3g} GiB of states per GPU)")
    return out


def states_remedies(cost: CostModel) -> str:
    """What would fit the model states, from ``cost``'s layout (:func:`states_fit_options`), or
    that neither direction alone does; then the model-side options."""
    options = states_fit_options(cost)
    fit = ("they alone would fit (activations need room beside them) with " + ", or ".join(options) if options
           else "neither more stages alone nor sharding alone fits them, up to 4096 GPUs")
    return (f"{fit}; or train a smaller model, or LoRA (frozen weights keep no gradients or optimizer states; the "
            f"cost profile prices {cost.states.precision.state_bytes_per_param:g} bytes per parameter, full "
            f"fine-tuning)")


def states_advice(cost: CostModel) -> str:
    """Why nothing fits when the model states leave no room: the states per GPU against the budget,
    and what would fit them (:func:`states_remedies`)."""
    states, budget = states_per_gpu(cost), cost.memory_budget_bytes
    over = "exceed" if states >= budget else "leave too little room for any activations in"
    return (f"the model states (weights, gradients, optimizer states) take {states / 2**30:.3g} GiB per GPU at "
            f"pp_degree={cost.dims.pp_degree}, sp_degree={cost.dims.sp_degree}, dp_degree={cost.dims.dp_degree}, "
            f"shard={cost.dims.shard.name!r}, and {over} the {budget / 2**30:.3g} GiB budget per GPU, so no sequence fits "
            f"at any length; {states_remedies(cost)}")
