"""``PlanResult``: the outcome of planning one step with one schedule, pipeline or not."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infinipipe_hf.planner.registry import get_schedule


@dataclass
class PlanResult:
    """The outcome of planning one step with one schedule."""

    schedule: str
    plan: Any
    """The best plan (``Plan`` of a pipeline schedule, ``RoundPlan`` of an alternative), or None."""
    simulation: Any
    """Its simulation (``SimulationResult`` / ``RoundSimulation``), or None."""
    feasible: bool
    error: str | None
    planning_time_s: float
    candidates: list[dict] = field(default_factory=list)
    """One entry per configuration tried: knob values, step time, feasibility."""
    sp_degree: int = 1
    """GPUs per stage a pipeline plan (or the failed search) was costed for."""
    shard: str = "none"
    """Model-state sharding a pipeline plan (or the failed search) was costed for."""
    world_size: int = 1
    """GPUs an alternative was planned for."""

    def summary(self) -> dict:
        """The ``--json`` object of the planner CLI (docs/contracts.md), as the schedule reports it."""
        return get_schedule(self.schedule).summary(self)
