"""What a simulation of a plan returns: its step time, bubbles, recompute and memory."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ActionEvent:
    dp_rank: int
    stage: int
    action: str
    start_s: float
    end_s: float
    recompute_s: float
    """Part of a backward spent recomputing checkpointed layers (0 for forwards)."""


@dataclass
class SimulationResult:
    step_time_s: float
    tokens_per_s: float
    bubble_fraction: float
    """Idle share of stage-time over the step (all stages of all replicas)."""
    peak_memory_bytes: list[float]
    """Per stage, max over DP replicas."""
    memory_budget_bytes: float
    recompute_time_s: float
    """Total over stages and replicas."""
    events: list[ActionEvent]
    memory_timeline: dict[tuple[int, int], list[tuple[float, float]]]
    """(dp_rank, stage) -> (time, bytes) steps: each action's peak from its start on."""
    feasible: bool
    """Every stage's peak is within the budget."""
    info: dict[str, Any] = field(default_factory=dict)
    recompute_fraction: float = 0.0
    """Recompute share of stage-time over the step (``recompute_time_s`` over ``step_time_s`` times
    stages and replicas); with ``bubble_fraction``, the two overheads a plan trades."""

    def to_dict(self, *, include_events: bool = False) -> dict:
        d = {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "memory_budget_bytes": self.memory_budget_bytes,
            "recompute_time_s": self.recompute_time_s,
            "recompute_fraction": self.recompute_fraction,
            "feasible": self.feasible,
            "info": dict(self.info),
        }
        if include_events:
            d["events"] = [asdict(e) for e in self.events]
            d["memory_timeline"] = {f"{r},{s}": [list(p) for p in pts]
                                    for (r, s), pts in sorted(self.memory_timeline.items())}
        return d
