"""Plans for an engine's steps: the default planner, and the agreement of every rank on one plan.

The default planner calls the planner's ``plan_step`` with the engine's degrees, layer split,
memory budget, host memory budget (``InfiniPipeConfig.host_budget_bytes``) and the checkpoint
levels its stage can run.  This is the runtime's one seam into
the planner; the imports are lazy, so the engine imports without it.  A planner can be injected
instead (``planner=callable(lengths, engine) -> Plan | PlanResult``) so tests and baselines do
not depend on the default one.  Plans must be identical on every rank: ``make_plan`` checks that
they are (or takes rank 0's) before any rank runs one.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import state_offload


def memory_budget_bytes(config: InfiniPipeConfig, device: torch.device) -> float | None:
    """The plan's memory limit per device (``None``: unlimited): ``config.memory_budget_gib``, or the
    CUDA device's memory less the margin and reserve (``InfiniPipeConfig.memory_budget``, the rule
    the planner CLI applies to ``--gpu-memory-gib`` too)."""
    total = None
    if config.memory_budget_gib is None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    return config.memory_budget(total).budget_bytes


def host_budget_bytes(config: InfiniPipeConfig, device: torch.device) -> float:
    """Host bytes per rank a plan may fill: ``config.host_budget_bytes()``, except 0 on a CPU device
    when ``host_memory_gib`` is not given: its memory *is* host memory, already under the device
    budget, so offloading would copy within the same RAM and count it twice.  Giving
    ``host_memory_gib`` or a ``state_offload`` keeps a host tier on CPU (separate storage, as the
    exactness tests use)."""
    if config.host_memory_gib is None and device.type == "cpu" and not state_offload(config.state_offload).offloaded:
        return 0.0
    return config.host_budget_bytes()


def attention_table(config: InfiniPipeConfig) -> dict:
    """The profile's measured attention-backend table (empty when it has none), for ``"auto"``."""
    from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile

    if config.attention_backend != "auto":
        return {}
    profile = HardwareProfile.load(config.profile) if config.profile is not None else default_profile()
    return dict(profile.attention_backends)


def runnable_checkpoint_levels(engine) -> tuple[str, ...]:
    """The configured levels this stage can run (the others dropped with a warning).  The planner
    offers ``offload_attn`` and ``offload_pair`` (``keep_attn`` in host memory, the latter in pairs)
    only beside ``keep_attn``, so a dropped ``keep_attn`` takes them along: their layers are planned
    at ``offload`` or ``full`` instead."""
    from infinipipe_hf.ir.levels import KEEP_ATTN
    from infinipipe_hf.runtime.recompute.layers import runnable_levels

    levels = tuple(engine.config.checkpoint_levels)
    kept, why = runnable_levels(levels, [lay for _, lay in engine.stage.decoder_layers()], engine.device,
                                engine.dtype)
    if why is not None:
        if KEEP_ATTN in levels and KEEP_ATTN not in kept:
            why += (" (offload_attn and offload_pair, keep_attn in host memory, go with it: offload or "
                    "full instead)")
        warnings.warn(f"checkpoint_levels={levels}: planning with {kept or 'whole layers only'}: {why}. "
                      f"Set InfiniPipeConfig(checkpoint_levels={kept!r}) to silence this", stacklevel=4)
        engine.config.checkpoint_levels = kept
    return kept


class DefaultPlanner:
    """``plan_step`` for an engine's batch; the cost profile is loaded on first use."""

    def __init__(self) -> None:
        self.profile = None

    def _load_profile(self, engine):
        from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
        from infinipipe_hf.runtime.attention.select import backend_for_kind, masks_context

        c = engine.config
        profile = HardwareProfile.load(c.profile) if c.profile is not None else default_profile()
        routed = [backend_for_kind(engine.runner.backend, kind) for kind in ("slice", "hybrid")]
        if any(masks_context(fn) for fn in routed):
            # The SDPA fallback runs a slice with context through a dense mask (in the compute dtype),
            # computing the masked blocks too: plan with both, as this rank really runs it.
            mask_bytes = profile.attention_mask_bytes_per_element or float(
                torch.finfo(engine.dtype).bits // 8 if engine.dtype.is_floating_point else 4)
            profile = dataclasses.replace(profile, attention_mask_bytes_per_element=mask_bytes,
                                          context_pairs="rectangle")
        return profile

    def request(self, engine) -> dict:
        """``plan_step``'s keyword arguments for this engine (its layout and the planning options):
        plain data, so the same request gives the same plan here or in a planner process
        (``planner/worker.py``)."""
        from infinipipe_hf.planner.search.api import PlanOptions

        c = engine.config
        if self.profile is None:
            self.profile = self._load_profile(engine)
        settings = {**c.plan_settings(), "checkpoint_levels": runnable_checkpoint_levels(engine)}
        options = PlanOptions(**settings, memory_budget_bytes=memory_budget_bytes(c, engine.device),
                              profile=self.profile, layers_per_stage=list(engine.layers_per_stage),
                              host_memory_budget_bytes=host_budget_bytes(c, engine.device))
        return dict(spec=engine.spec, dims=engine.layout.dims, options=options)

    def __call__(self, lengths: list[int], engine):
        from infinipipe_hf.planner.search.api import plan_step

        return plan_step(lengths, **self.request(engine))


def plan_locally(engine, lengths: list[int]) -> tuple[Plan, Any]:
    """This rank's own plan of ``lengths`` and its simulation, with no communication."""
    planner = engine.planner if engine.planner is not None else engine.default_planner
    return plan_from_result(planner(lengths, engine), lengths)


def plan_from_result(result, lengths: list[int]) -> tuple[Plan, Any]:
    """``(plan, simulation or None)`` from a planner's answer; ``ValueError`` when it found none."""
    if isinstance(result, Plan):
        return result, None
    if not getattr(result, "feasible", False) or result.plan is None:
        # The planner's error names the cause (model states, one sequence, the batch) and what would
        # change it; a planner that gives none gets the general advice.
        why = getattr(result, "error", None) or ("the planner gave no reason; raise memory_budget_gib or "
                                                 "pp_degree, or lower tokens_per_step")
        raise ValueError(f"no feasible plan for a batch of {len(lengths)} sequences "
                         f"({sum(lengths)} tokens, longest {max(lengths)}): {why}")
    return result.plan, getattr(result, "simulation", None)


def make_plan(engine, lengths: list[int]) -> tuple[Plan, Any]:
    """Plan a step, the same on every rank (collective when the world has more than one rank)."""
    if engine.layout.world_size == 1:
        return engine.plan_locally(lengths)
    step = engine.step_count
    if engine.config.seed_plan_on_rank0:
        return engine.plan_agreement.from_rank0(lambda: engine.plan_locally(lengths), step=step)
    planned = engine.plan_locally(lengths)
    if engine.plan_agreement.all_agree(planned[0], step=step):
        return planned
    # A planner with a wall-clock limit (the MILP solver) can differ between ranks; running
    # different plans would mismatch shapes, so everyone takes rank 0's.
    warnings.warn(f"step {step}: ranks planned differently (is the planner "
                  f"deterministic? a solver time limit can make it not); using rank 0's plan. "
                  f"Set InfiniPipeConfig(seed_plan_on_rank0=True) to always do so", stacklevel=4)
    return engine.plan_agreement.from_rank0(lambda: planned, step=step)


def check_plan(engine, plan: Plan, lengths: list[int]) -> None:
    """``ValueError`` when ``plan`` was not made for this engine's degrees, layers and batch."""
    lay = engine.layout
    if plan.pp_degree != lay.pp_degree or plan.dp_degree != lay.dp_degree:
        raise ValueError(f"plan is for pp={plan.pp_degree}, dp={plan.dp_degree} but the engine "
                         f"runs pp={lay.pp_degree}, dp={lay.dp_degree}; plan with the engine's degrees")
    if list(plan.sequences) != list(lengths):
        raise ValueError(f"plan covers sequence lengths {list(plan.sequences)[:8]}... but the batch "
                         f"has {lengths[:8]}...; plan the same batch that you run")
    if plan.layers_per_stage and list(plan.layers_per_stage) != engine.layers_per_stage:
        raise ValueError(f"plan assumes layers per stage {plan.layers_per_stage}, the engine has "
                         f"{engine.layers_per_stage}; pass layers_per_stage=engine.layers_per_stage")
    validate_plan(engine, plan)


def validate_plan(engine, plan: Plan) -> None:
    """The planner's validator on a plan this rank is about to run, before any communication.

    Coverage, order, send/receive pairing, deadlock freedom and checkpoint counts (against the
    engine's layer split); memory is not checked (whoever made the plan chose its budget).  A bad
    plan raises ``PlanValidationError`` (a ``ValueError``) carrying the stage-by-time grid with the
    failing action marked, on every rank that holds it, instead of a wait that times out."""
    from infinipipe_hf.planner.validate.validator import validate

    if not plan.layers_per_stage:
        plan = dataclasses.replace(plan, layers_per_stage=list(engine.layers_per_stage))
    validate(plan, None, check_memory=False)
