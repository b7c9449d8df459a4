"""``PlanResult``: the outcome of planning one step with one schedule, pipeline or not."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from infinipipe_hf.layout import NO_SHARDING, ShardMode
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
    shard: ShardMode = NO_SHARDING
    """Model-state sharding a pipeline plan (or the failed search) was costed for."""
    world_size: int = 1
    """GPUs an alternative was planned for."""
    label: str | None = None
    """How tables name this result when the schedule appears twice (``epp (whole-group SP)``)."""
    beaten_bound_s: float | None = None
    """Set when planning stopped because no plan could beat the caller's step (``plan_step``'s
    ``beat_step_s``): a lower bound of the step the full search would have returned."""
    beaten_basis: str = "candidates"
    """What ``beaten_bound_s`` counts: ``candidates`` (every candidate's units replayed without
    recompute, before any is planned) or ``finalists`` (the planned finalists' units replayed with
    nothing recomputed or copied to host memory, before the final solve)."""

    @property
    def name(self) -> str:
        return self.label or self.schedule

    @property
    def host_peak_memory_bytes(self) -> float:
        """Peak host bytes per GPU of the plan (0.0 without a plan or without a host tier)."""
        info = getattr(self.plan, "info", None) or {}
        return float(info.get("host_peak_memory_bytes") or 0.0)

    @property
    def file_name(self) -> str:
        """``name`` as a file-name part (``epp-whole-group-sp``)."""
        return re.sub(r"[^A-Za-z0-9.]+", "-", self.name).strip("-")

    def summary(self) -> dict:
        """The ``--json`` object of the planner CLI (docs/contracts.md), as the schedule reports it
        (with ``label`` when set)."""
        d = get_schedule(self.schedule).summary(self)
        info = getattr(self.plan, "info", None) or {}
        for key in ("host_peak_memory_bytes", "host_peak_bytes_per_stage"):  # a pipeline plan's host tier
            if key in info:
                d.setdefault(key, info[key])
        if self.shard.sharded and hasattr(self.plan, "grad_reduce"):
            d["grad_reduce"] = self.plan.grad_reduce  # when the sharded stages reduce gradients
        copy_totals = getattr(self.simulation, "copy_totals", None)  # a pipeline plan's host copy lanes
        if copy_totals is not None:
            d.update(copy_totals())
        if self.label:
            d["label"] = self.label
        return d
