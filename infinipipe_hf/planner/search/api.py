"""Planning one step: ``plan_step`` for the pipeline schedules, ``plan_alternative`` for the others.

For each knob setting of the schedule (EPP's slice count, a baseline's packing length and slice
count, an alternative's group size...) the search (:mod:`.loop`) builds units or micro-batches,
solves checkpointing, simulates, and keeps the fastest plan that fits memory.  Every schedule
goes through the same cost model, solver and simulator, so they are compared on equal terms.

With sequence parallelism a stage is ``sp_degree`` GPUs sharing each unit, so units may be
``sp_degree`` times longer for the same per-GPU work: the grids keep slices of at least
``MIN_SLICE_TOKENS`` tokens *per GPU*, packing floors scale with ``sp_degree``, and every time
and byte comes per GPU from the cost model.  The alternatives are planned for ``world_size``
GPUs, every GPU running every layer.

Searching is the trade-off: a handful of candidates per batch costs milliseconds each and buys
robustness against a cost model that is only approximately right about where the optimum lies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

from infinipipe_hf.ir.grad_reduce import check_grad_reduce
from infinipipe_hf.ir.levels import CHECKPOINTING, FINER_LEVELS, check_levels, check_solver_time_limit
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.batch.dp_assign import assign_sequences, idle_replicas
from infinipipe_hf.planner.batch.select import check_batch
from infinipipe_hf.planner.checkpointing.problem import SHARING
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.registry import ALTERNATIVES, PIPELINE_SCHEDULES, SCHEDULES
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext
from infinipipe_hf.planner.search.adopted import adopted_rounds, check_adopt_rounds_of
from infinipipe_hf.planner.search.finish import finalists_bound_s, finish_pipeline, host_states_message
from infinipipe_hf.planner.search.grad_reduce import plan_each_reduce, reduce_modes
from infinipipe_hf.planner.search.loop import plan_rounds, run_search
from infinipipe_hf.planner.search.result import PlanResult
from infinipipe_hf.planner.search.whole_units import try_whole_sequences


@dataclass(frozen=True)
class PlanOptions:
    """What :func:`plan_step` takes beside the batch, the model and the layout."""

    schedule: str = "epp"
    """A pipeline schedule of :data:`~infinipipe_hf.planner.registry.PIPELINE_SCHEDULES`."""
    memory_budget_bytes: float | None = None
    """Memory per GPU a plan stays under (``None``: the profile's memory)."""
    profile: HardwareProfile | None = None
    """The cost profile (``None``: the shipped one)."""
    layers_per_stage: Sequence[int] | None = None
    """Decoder layers per stage (``None``: balanced by cost)."""
    max_tokens_per_unit: int | None = None
    """Cap on a unit's tokens (``None``: chosen per batch)."""
    num_slices: Sequence[int] | None = None
    """Slice counts searched: of the longest sequence for EPP, per micro-batch for seq1f1b (a
    static setting; its packing length, slice balance and checkpointing are still tuned)."""
    checkpointing: str = "adaptive"
    """``adaptive`` (the solver picks per stage and unit), ``none`` or ``full``."""
    loss_chunk_tokens: int = 4096
    """Tokens per LM-head + loss chunk on the last stage."""
    solver_time_limit_s: float = 0.0
    """Wall-clock limit of the adaptive checkpointing's branch and bound (HiGHS MILP) on the winning
    candidate; 0: none, the rounded LP relaxation and the greedy decide, and the same batch gets
    the same plan however fast or loaded the machine is.  A limit may save a little recompute
    (docs/algorithms.md), but where it binds the plan depends on the machine's speed and load."""
    checkpoint_levels: Sequence[str] = FINER_LEVELS
    """Levels inside a decoder layer adaptive checkpointing may use beside whole layers (``()``:
    whole layers only); see docs/checkpoint_levels.md.  Baselines keep their static setting."""
    checkpoint_sharing: str = "cell"
    """``cell`` (a count per stage and unit) or ``diagonal`` (shared along backward diagonals, the
    paper's formulation)."""
    sp_rounds: bool | None = None
    """Elastic SP rounds (short sequences on SP sub-groups, docs/algorithms.md); ``None`` uses them
    whenever the schedule has them and ``sp_degree > 1`` (:func:`resolve_sp_rounds`)."""
    host_memory_budget_bytes: float | None = None
    """Host memory per GPU a plan may hold: offloaded layer inputs, KV stores, model states
    (``None`` or 0: no host tier, nothing is offloaded)."""
    grad_reduce: str = "auto"
    """When sharded stages reduce gradients: ``step``, ``unit`` or ``auto`` (both priced where
    ``unit`` can run, the faster plan kept; :mod:`.grad_reduce`)."""
    adopt_rounds_of: Sequence[str] = ()
    """Non-pipeline alternatives (``flexsp``, ``ulysses-zero3``, ``ring-cp-packed``) whose own plan
    of the batch EPP also plans as a candidate, each group a unit on an SP sub-group (pp 1, dp 1,
    SP rounds: the layout holding their plans; :mod:`.adopted`).  The layout search sets it where
    such an alternative beats EPP's own plan."""

    def __post_init__(self) -> None:
        check_grad_reduce(self.grad_reduce)
        object.__setattr__(self, "adopt_rounds_of", check_adopt_rounds_of(self.adopt_rounds_of))
        check_solver_time_limit(self.solver_time_limit_s)
        host = self.host_memory_budget_bytes
        if host is not None and not host >= 0:
            raise ValueError(f"host_memory_budget_bytes={host!r} must be >= 0 bytes per GPU (0 or None: no host "
                             f"tier); pass the host memory a GPU may use, e.g. 256 * 2**30")

    def cost(self, spec: ModelSpec, dims: ParallelDims) -> CostModel:
        """The cost model these options plan with on ``dims``."""
        return CostModel(spec, self.profile, dims, layers_per_stage=self.layers_per_stage,
                         memory_budget_bytes=self.memory_budget_bytes, loss_chunk_tokens=self.loss_chunk_tokens,
                         host_budget_bytes=self.host_memory_budget_bytes or 0.0,
                         grad_reduce="unit" if self.grad_reduce == "unit" else "step")


def plan_step(lengths: Sequence[int], spec: ModelSpec, dims: ParallelDims | None = None,
              options: PlanOptions | None = None, *, cost: CostModel | None = None,
              beat_step_s: float | None = None) -> PlanResult:
    """Plan one training step of ``lengths`` (one global batch) on the layout ``dims`` with
    ``options`` (:class:`PlanOptions`); a ``cost`` passed in is used instead of building one (its
    own ``dims`` when ``dims`` is not given).  A batch of fewer sequences than ``dp_degree`` leaves
    replicas idle (``plan.info["idle_replicas"]``).  ``beat_step_s``: a step the caller already
    has (a layout search's best); when the schedule proves no plan here reaches below it, the
    search stops there and the result is infeasible with ``beaten_bound_s`` set; otherwise the
    result is exactly the one without it.
    """
    t0 = time.perf_counter()
    o = PlanOptions() if options is None else options
    if o.schedule not in PIPELINE_SCHEDULES:
        what = "is not a pipeline schedule" if o.schedule in ALTERNATIVES else "is not known"
        raise ValueError(f"schedule={o.schedule!r} {what}; use one of {', '.join(PIPELINE_SCHEDULES)} (non-pipeline "
                         f"{', '.join(ALTERNATIVES)}: infinipipe_hf.planner.search.api.plan_alternative)")
    levels = _check_checkpointing(o.checkpointing, o.checkpoint_levels, o.checkpoint_sharing)
    check_batch(lengths)
    lengths = [int(n) for n in lengths]
    if cost is None:
        cost = o.cost(spec, ParallelDims() if dims is None else dims)
    elif dims is not None and cost.dims != dims:
        raise ValueError(f"the cost model passed to plan_step was built for {cost.dims}, not {dims}; build the "
                         f"CostModel with the layout you plan")
    dims = cost.dims
    modes = reduce_modes(o.grad_reduce, cost)
    if len(modes) > 1 or modes[0] != cost.ctx.grad_reduce:
        return plan_each_reduce(lambda mode, c, beat: plan_step(lengths, spec, options=replace(o, grad_reduce=mode),
                                                                cost=c, beat_step_s=beat), cost, modes, t0, beat_step_s)
    stop = host_states_message(cost, o.schedule)
    if stop is not None:
        return PlanResult(o.schedule, None, None, False, stop, time.perf_counter() - t0, [], dims.sp_degree,
                          dims.shard)
    replicas = assign_sequences(lengths, dims.dp_degree, cost)
    sched = SCHEDULES[o.schedule]
    rounds = resolve_sp_rounds(o.sp_rounds, dims.sp_degree, o.schedule)
    ctx = PipelineContext(lengths, replicas, cost, sched.checkpoint_policy(o.checkpointing), o.max_tokens_per_unit,
                          o.num_slices, o.solver_time_limit_s, rounds, adopted_rounds(lengths, spec, cost, o, rounds))
    bound = None if beat_step_s is None else sched.candidates_bound(ctx, beat_step_s)
    if bound is not None and bound >= beat_step_s:
        return PlanResult(o.schedule, None, None, False, f"no {o.schedule} plan on {dims.label} can run a step under "
                          f"{beat_step_s:.4g} s: every candidate takes at least {bound:.4g} s even without recompute",
                          time.perf_counter() - t0, [], dims.sp_degree, dims.shard, beaten_bound_s=bound)
    state = run_search(sched, ctx)
    if o.schedule == "epp":  # EPP's plan space also holds whole sequences with tiled MLPs
        try_whole_sequences(ctx, state, sched.name)
    bound = None if beat_step_s is None or state.best is None else finalists_bound_s(state, cost)
    if bound is not None and bound >= beat_step_s:
        return PlanResult(o.schedule, None, None, False, f"no {o.schedule} plan on {dims.label} can run a step under "
                          f"{beat_step_s:.4g} s: its finalists take at least {bound:.4g} s with nothing recomputed "
                          f"or copied to host memory", time.perf_counter() - t0, state.tried, dims.sp_degree, dims.shard,
                          beaten_bound_s=bound, beaten_basis="finalists")
    result = finish_pipeline(sched, ctx, state, t0, levels, o.checkpoint_sharing)
    idle = idle_replicas(len(lengths), dims)
    if idle and result.plan is not None:
        result.plan.info["idle_replicas"] = idle  # the batch has fewer sequences than replicas
    if result.plan is not None and dims.shard.sharded:
        result.plan.grad_reduce = modes[0]  # the runtime reduces as the plan was priced
    return result


def plan_alternative(lengths: Sequence[int], spec: ModelSpec, schedule: str, *, world_size: int,
                     memory_budget_bytes: float | None = None, profile: HardwareProfile | None = None,
                     gpus_per_node: int | None = None, checkpointing: str | int = "adaptive",
                     cost: FlatCost | None = None, **knobs) -> PlanResult:
    """Plan one step of ``lengths`` with a non-pipeline ``schedule`` on ``world_size`` GPUs.

    ``checkpointing``: ``adaptive`` (the least uniform count that fits, per knob setting), ``none``,
    ``full`` or a fixed layer count.  ``knobs`` restrict the search: ``sp_degrees`` and
    ``pack_tokens`` (ulysses-zero3), ``cp_degrees`` (ring-cp), ``sp_degrees``, ``solver``
    (``greedy`` / ``milp``) and ``milp_time_limit_s`` (flexsp).  ``cost`` may be passed to reuse
    one :class:`FlatCost` over many batches (it must be for this ``spec`` and ``world_size``).
    """
    t0 = time.perf_counter()
    if schedule not in ALTERNATIVES:
        raise ValueError(f"schedule={schedule!r} is not a non-pipeline schedule; use one of {', '.join(ALTERNATIVES)}")
    check_batch(lengths)
    if cost is None:
        profile = profile or default_profile()
        budget = profile.memory_gib * GIB if memory_budget_bytes is None else memory_budget_bytes
        cost = FlatCost.of(spec, world_size, budget, profile, gpus_per_node)
    elif cost.world_size != world_size or cost.spec != spec:
        raise ValueError(f"the FlatCost passed was built for {cost.world_size} GPUs and another model; build "
                         f"it with world_size={world_size} and this spec")
    result = plan_rounds(schedule, [int(n) for n in lengths], cost, checkpointing=checkpointing, **knobs)
    result.planning_time_s = time.perf_counter() - t0
    return result


def resolve_sp_rounds(asked: bool | None, sp_degree: int, schedule: str = "epp") -> bool:
    """Whether a plan uses elastic SP rounds: ``asked`` when given (``ValueError`` when it cannot be
    honoured: one rank per stage, an SP degree that is not a power of two, a schedule without
    rounds), else whenever the schedule has them and ``sp_degree`` is a power of two above 1."""
    has = getattr(SCHEDULES.get(schedule), "elastic_sp_rounds", False)
    possible = sp_degree > 1 and sp_degree & (sp_degree - 1) == 0
    if asked is None:
        return bool(has and possible)
    if not isinstance(asked, bool):
        raise ValueError(f"sp_rounds must be True, False or None (automatic), got {asked!r}")
    if asked and sp_degree == 1:
        raise ValueError("sp_rounds=True asks for elastic SP rounds, which split each stage's SP ranks into "
                         "sub-groups, but sp_degree=1 gives a stage one rank; set sp_degree >= 2 (a power of two) "
                         "or leave sp_rounds unset")
    if asked and not possible:
        raise ValueError(f"sp_rounds=True needs sp_degree a power of two (aligned sub-groups of 1, 2, 4... "
                         f"ranks tile the stage), got sp_degree={sp_degree}; use sp_degree in 2, 4, 8, 16... "
                         f"or sp_rounds=False")
    if asked and not has:
        with_rounds = [n for n, s in SCHEDULES.items() if getattr(s, "elastic_sp_rounds", False)]
        raise ValueError(f"sp_rounds=True: schedule={schedule!r} runs every unit on the whole SP group; elastic "
                         f"SP rounds are {', '.join(with_rounds)}'s, or leave sp_rounds unset")
    return asked


def _check_checkpointing(checkpointing: str, checkpoint_levels: Sequence[str], sharing: str) -> tuple[str, ...]:
    """Check the checkpointing choices; return the finer levels."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not known; use {', '.join(CHECKPOINTING[:-1])} "
                         f"or {CHECKPOINTING[-1]}")
    levels = check_levels(checkpoint_levels)
    if sharing not in SHARING:
        raise ValueError(f"checkpoint_sharing={sharing!r} is not known; use {' or '.join(SHARING)}")
    return levels
