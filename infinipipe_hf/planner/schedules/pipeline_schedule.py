"""What every pipeline schedule shares: its search context, the unit cap, simulation and report.

A pipeline schedule turns a batch into units, groups them into 1F1B pipelines per DP replica and
orders each stage's actions (:mod:`.pipeline`); subclasses choose the units, the knobs and the
warm-up.  Candidates are compared under ``checkpoint_policy`` (the least uniform count for the
baselines, one static setting as Megatron and Seq1F1B run; the greedy adaptive solve for EPP).
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.schedules.base import PIPELINE, Knobs, Outcome, Schedule
from infinipipe_hf.planner.simulate.result import SimulationResult
from infinipipe_hf.planner.simulate.simulator import simulate


@dataclass(frozen=True)
class PipelineContext:
    """One batch as a pipeline schedule's candidates see it."""

    lengths: list[int]
    replicas: list[list[int]]
    """Sequence ids per DP replica."""
    cost: CostModel
    policy: str
    """Checkpoint policy candidates are compared with (``Schedule.checkpoint_policy``)."""
    max_tokens_per_unit: int | None = None
    num_slices: Sequence[int] | None = None
    """Slice counts the caller restricts the search to (EPP's longest sequence, seq1f1b's per micro-batch)."""
    time_limit_s: float = 0.25
    sp_rounds: bool = False
    """Also plan short sequences on SP sub-groups in rounds (EPP at ``sp_degree > 1``)."""
    adopted: tuple = ()
    """``(alternative, rounds)`` pairs: a non-pipeline alternative's plan of this batch as rounds of
    ``(GPUs, whole sequences)`` groups, which EPP also plans as a candidate (``adopt_rounds_of``)."""
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """What a schedule works out once per context (EPP's ranked knob settings)."""


class PipelineSchedule(Schedule):
    """A schedule whose plan is per-stage action lists of 1F1B pipelines (module docstring)."""

    kind = PIPELINE
    elastic_sp_rounds: ClassVar[bool] = False
    """At ``sp_degree > 1`` the schedule can run units on SP sub-groups in rounds (``sp_rounds``)."""
    static_packing: ClassVar[bool] = False
    """A run can fix its packing length (and slice count) once: ``static_pipeline_baseline``."""

    def checkpoint_policy(self, requested: str) -> str:
        """The policy candidates are compared with: one static setting (``uniform``) for ``adaptive``."""
        return "uniform" if requested == "adaptive" else requested

    @abstractmethod
    def warmup(self, dims: ParallelDims, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        """Forwards per stage of ``dims`` before the first backward of a pipeline of ``units``
        (``num_slices``: the knob's slice count per micro-batch)."""

    @abstractmethod
    def leanest_plan(self, cost: CostModel, n: int, max_slices: int) -> Plan:
        """The least memory-hungry plan of one sequence of ``n`` tokens: every layer checkpointed,
        cut into as many slices (at most ``max_slices``) as the schedule can."""

    def candidates_bound(self, ctx: PipelineContext, below_s: float) -> float | None:
        """A proven lower bound of the step this schedule's search on ``ctx`` may return (it may stop
        at the first value under ``below_s``), or None where it has none (the default)."""
        return None

    def reject(self, plan: Plan, knobs: Knobs, ctx: PipelineContext) -> str | None:
        cap = ctx.max_tokens_per_unit
        biggest = max(u.num_tokens for u in plan.units) if cap is not None else 0
        if cap is not None and biggest > cap:
            # A knob that makes units larger than the user's cap is simply not a candidate.
            return (f"{self.name} with {knobs.record()} makes units of {biggest} tokens, over "
                    f"max_tokens_per_unit={cap}; raise max_tokens_per_unit "
                    f"or use schedule='epp' or 'seq1f1b', which cut long sequences")
        return None

    def simulate(self, plan: Plan, ctx: PipelineContext) -> SimulationResult:
        return simulate(plan, ctx.cost)

    def record(self, knobs: Knobs, plan: Plan, sim: SimulationResult) -> dict:
        return {**knobs.record(), "feasible": sim.feasible, "step_time_s": sim.step_time_s,
                "recompute_time_s": sim.recompute_time_s,
                **({"checkpoint_layers": plan.info["uniform_layers"]} if "uniform_layers" in plan.info else {})}

    def summary(self, result: Outcome) -> dict:
        sim = result.simulation
        plan = result.plan
        d = {
            "schedule": result.schedule,
            "feasible": result.feasible,
            "step_time_s": sim.step_time_s if sim else None,
            "tokens_per_s": sim.tokens_per_s if sim and result.feasible else 0.0,
            "bubble_fraction": sim.bubble_fraction if sim else None,
            "peak_memory_bytes": list(sim.peak_memory_bytes) if sim else None,
            "memory_budget_bytes": sim.memory_budget_bytes if sim else None,
            "recompute_time_s": sim.recompute_time_s if sim else None,
            "recompute_fraction": sim.recompute_fraction if sim else None,
            "num_pipelines": plan.num_pipelines if plan else 0,
            "num_units": len(plan.units) if plan else 0,
            "num_tokens": plan.num_tokens if plan else None,
            "planning_time_s": result.planning_time_s,
            "sp_degree": result.sp_degree,
            "shard": result.shard.name,
        }
        if plan is not None:
            d["layers_per_stage"] = list(plan.layers_per_stage)
            d["info"] = dict(plan.info)
        if result.error:
            d["error"] = result.error
        return d
