"""The systems HF users run for long context instead of a pipeline, priced by the same cost model.

- ``ulysses-zero3`` (:mod:`.ulysses_zero3`): DeepSpeed-Ulysses SP of one size with ZeRO-3,
  batch-level packing (accelerate ``sp_size``, DeepSpeed);
- ``ring-cp`` (:mod:`.ring_cp`): FSDP2 with ring-attention context parallelism, one sequence per
  micro-batch (accelerate ``cp_size``, torchtitan);
- ``flexsp`` (:mod:`.flexsp`): FlexSP's per-step heterogeneous SP groups chosen by a solver.

None of them is a pipeline: every GPU runs every layer, so they have their own plan form
(:class:`~.round_plan.RoundPlan`) and simulation (:func:`~.round_plan.simulate_rounds`) on
:class:`~.flat_cost.FlatCost`, which takes its per-layer times, activation bytes, all-to-all
and collective prices from the same profile and cost model as the pipeline schedules.  They are
planned for ``world_size`` GPUs; the CLI gives them the pipeline layout's ``pp x sp x dp`` GPUs, so
``--schedule all`` compares every schedule on the same machines.  The runtime does not execute
them: they exist to be compared with.
"""
from __future__ import annotations

import time
from typing import Sequence

from infinipipe_hf.planner.cost.profile import HardwareProfile
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost, FlatLayout
from infinipipe_hf.planner.alternatives.flexsp import plan_flexsp
from infinipipe_hf.planner.alternatives.ring_cp import plan_ring_cp
from infinipipe_hf.planner.alternatives.round_plan import (AlternativeResult, GroupRun, RoundPlan,
    simulate_rounds)
from infinipipe_hf.planner.alternatives.ulysses_zero3 import plan_ulysses_zero3

ALTERNATIVES = ("ulysses-zero3", "ring-cp", "flexsp")
_PLANNERS = {"ulysses-zero3": plan_ulysses_zero3, "ring-cp": plan_ring_cp, "flexsp": plan_flexsp}

__all__ = ["ALTERNATIVES", "AlternativeResult", "FlatCost", "FlatLayout", "GroupRun", "RoundPlan",
           "plan_alternative", "simulate_rounds"]


def plan_alternative(lengths: Sequence[int], spec: ModelSpec, schedule: str, *, world_size: int,
                     memory_budget_bytes: float | None = None, profile: HardwareProfile | None = None,
                     gpus_per_node: int | None = None, checkpointing: str | int = "adaptive",
                     cost: FlatCost | None = None, **knobs) -> AlternativeResult:
    """Plan one step of ``lengths`` with a non-pipeline ``schedule`` on ``world_size`` GPUs.

    ``checkpointing``: ``adaptive`` (the least uniform count that fits, per knob setting), ``none``,
    ``full`` or a fixed layer count.  ``knobs`` restrict the search: ``sp_degrees`` and
    ``pack_tokens`` (ulysses-zero3), ``cp_degrees`` (ring-cp), ``sp_degrees``, ``solver``
    (``greedy`` / ``milp``) and ``milp_time_limit_s`` (flexsp).  ``cost`` may be passed to reuse
    one :class:`FlatCost` over many batches (it must be for this ``spec`` and ``world_size``).
    """
    from infinipipe_hf.planner.search.api import check_batch  # api is the pipeline planner; imported lazily to keep this light

    t0 = time.perf_counter()
    if schedule not in _PLANNERS:
        raise ValueError(f"schedule={schedule!r} is not a non-pipeline schedule; use one of {', '.join(ALTERNATIVES)}")
    check_batch(lengths)
    if cost is None:
        from infinipipe_hf.planner.cost.model import GIB
        from infinipipe_hf.planner.cost.profile import default_profile

        profile = profile or default_profile()
        budget = profile.memory_gib * GIB if memory_budget_bytes is None else memory_budget_bytes
        cost = FlatCost.of(spec, world_size, budget, profile, gpus_per_node)
    elif cost.world_size != world_size or cost.spec != spec:
        raise ValueError(f"the FlatCost passed was built for {cost.world_size} GPUs and another model; build "
                         f"it with world_size={world_size} and this spec")
    result = _PLANNERS[schedule]([int(n) for n in lengths], cost, checkpointing=checkpointing, **knobs)
    result.planning_time_s = time.perf_counter() - t0
    return result
