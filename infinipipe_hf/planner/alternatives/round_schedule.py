"""What the non-pipeline schedules share: checkpointing choice, simulation, records and report.

None of them is a pipeline: every GPU runs every layer with ZeRO-3 states, the GPUs split into
groups that run one micro-batch each per round (:class:`~.round_plan.RoundPlan`), priced by
:func:`~.round_plan.simulate_rounds` on :class:`~.flat_cost.FlatCost`.  A step uses one uniform
checkpoint count: the least that fits the largest micro-batch (``adaptive``), every layer
(``full``), none, or a given count (a static setting serving a whole run).
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from infinipipe_hf.ir.levels import CHECKPOINTING
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import RoundPlan, RoundSimulation, simulate_rounds
from infinipipe_hf.planner.schedules.base import ROUNDS, Knobs, Outcome, Schedule


def resolve_checkpointing(checkpointing: str | int, num_layers: int) -> int | None:
    """``None`` (least that fits) or a fixed count, with a clear error for bad values."""
    if isinstance(checkpointing, str):
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={checkpointing!r} is not known; use {', '.join(CHECKPOINTING)} or a "
                             f"layer count 0..{num_layers}")
        return {"adaptive": None, "none": 0, "full": num_layers}[checkpointing]
    if isinstance(checkpointing, bool) or int(checkpointing) != checkpointing or not 0 <= checkpointing <= num_layers:
        raise ValueError(f"checkpointing={checkpointing!r}: a fixed count must be an integer in 0..{num_layers} "
                         f"(the model's decoder layers)")
    return int(checkpointing)


@dataclass(frozen=True)
class RoundContext:
    """One batch as a non-pipeline schedule's candidates see it."""

    lengths: list[int]
    cost: FlatCost
    checkpoint: int | None
    """A fixed uniform checkpoint count, or ``None`` for the least that fits."""
    sizes: list[int]
    """Group sizes searched."""


class RoundSchedule(Schedule):
    """A schedule whose plan is rounds of GPU groups (module docstring)."""

    kind = ROUNDS
    attention: ClassVar[str]
    """``ulysses`` (all-to-all SP) or ``ring`` (ring-attention CP)."""
    regroups_every_step: ClassVar[bool] = False
    """Groups are re-solved every step, so a run fixes only the checkpoint count."""

    @abstractmethod
    def context(self, lengths: list[int], cost: FlatCost, checkpointing: str | int = "adaptive",
                **options) -> RoundContext:
        """The search context of one batch; ``options`` restrict the schedule's knobs."""

    def simulate(self, plan: RoundPlan, ctx: RoundContext) -> RoundSimulation:
        return simulate_rounds(plan, ctx.cost)

    def record(self, knobs: Knobs, plan: RoundPlan, sim: RoundSimulation) -> dict:
        return {**knobs.record(), "checkpoint_layers": plan.checkpoint_layers, "feasible": sim.feasible,
                "step_time_s": sim.step_time_s}

    def infeasible_error(self, sim: RoundSimulation) -> str | None:
        return sim.error

    def infeasible_message(self, ctx: RoundContext, last_error: str | None) -> str:
        """Why no knob setting fits: the ZeRO-3 states, the longest sequence, or the last error."""
        name, lengths, cost = self.name, ctx.lengths, ctx.cost
        longest = max(lengths)
        seq = list(lengths).index(longest)
        top = max(ctx.sizes)
        group = cost.group(self.attention, top)
        cap = group.max_tokens(cost.spec.num_layers, cost.room_bytes)
        if cost.room_bytes <= 0:
            return (f"{name}: the ZeRO-3 model states alone need {cost.states.static_bytes / 2**30:.1f} GiB "
                    f"per GPU, over the {cost.memory_budget_bytes / 2**30:.1f} GiB budget; use more GPUs or a "
                    f"larger memory budget")
        if longest > cap:
            return (f"{name}: sequence {seq} of {longest} tokens does not fit {cost.memory_budget_bytes / 2**30:.1f} "
                    f"GiB per GPU even on {top} GPUs with every layer checkpointed (at most {cap} tokens fit); "
                    f"truncate longer documents, use more GPUs or a schedule that slices sequences (epp)")
        return f"{name}: no knob setting fits this batch; last candidate said: {last_error}"

    def summary(self, result: Outcome) -> dict:
        """The pipeline schedules' keys: ``num_pipelines`` is 0, ``num_units`` counts micro-batches,
        ``peak_memory_bytes`` has one entry (every GPU holds every layer), plus ``world_size``."""
        sim, plan = result.simulation, result.plan
        ok = result.feasible and sim is not None
        d = {
            "schedule": result.schedule,
            "feasible": result.feasible,
            "step_time_s": sim.step_time_s if ok else None,
            "tokens_per_s": sim.tokens_per_s if ok else 0.0,
            "bubble_fraction": sim.bubble_fraction if ok else None,
            "peak_memory_bytes": [sim.peak_memory_bytes] if ok else None,
            "memory_budget_bytes": sim.memory_budget_bytes if sim else None,
            "recompute_time_s": sim.recompute_time_s if ok else None,
            "num_pipelines": 0,
            "num_units": plan.num_micro_batches if plan and ok else 0,
            "num_tokens": sum(plan.sequences) if plan else None,
            "planning_time_s": result.planning_time_s,
            "world_size": result.world_size,
        }
        if plan is not None and ok:
            d["info"] = {**plan.knobs, "checkpoint_layers": plan.checkpoint_layers, "rounds": len(plan.rounds),
                         "padded_tokens": sim.padded_tokens, "attention": plan.attention}
        if result.error:
            d["error"] = result.error
        return d
