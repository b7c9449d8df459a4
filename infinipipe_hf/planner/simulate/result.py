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
class CopyEvent:
    """One interval of a stage's host copy stream (:mod:`.copy_lane`): what an action (or the step's
    end, ``action="step"``) copies between host and device memory beside its compute."""

    dp_rank: int
    stage: int
    action: str
    """The action whose copies these are (``F3``, ``B3``), or ``step`` for the copies after the
    stage's last backward (a per-step weight fetch, the CPU optimizer step's tail)."""
    start_s: float
    end_s: float
    """``start_s`` plus the copy stream's busy seconds (``copy_s + cpu_s``; for ``step``, its
    exposed seconds: the tail's copies and CPU work overlap each other)."""
    bytes: float
    """Host-device bytes moved, both directions."""
    copy_s: float
    """Seconds the host link takes for ``bytes``."""
    cpu_s: float
    """Host CPU seconds on the same chain (a gradient add on the host, the CPU optimizer step)."""
    exposed_s: float
    """The part of the chain the compute does not hide: exactly what the action's duration (or the
    stage's end) already includes for it."""
    sources: tuple[str, ...]
    """What is copied: ``offload`` (layer inputs), ``kv`` (an offloaded KV store), ``states``
    (weights fetched, gradients drained), ``step`` (the optimizer step's tail)."""
    sub_group: tuple[int, int] | None = None
    """``(offset, size)`` of the stage's SP ranks the action runs on (an elastic SP round's unit),
    None for all of them; ``bytes`` and the seconds are each of those GPUs'."""

    def on_rank(self, rank: int) -> bool:
        """Whether SP rank ``rank`` of the stage runs these copies."""
        return self.sub_group is None or rank in range(*_span(self.sub_group))


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
    copy_events: list[CopyEvent] = field(default_factory=list)
    """Each stage's host copy stream (empty without a host tier); its exposed seconds are inside
    the action times already, so the step time is the same with or without them."""

    @property
    def host_copy_s(self) -> float:
        """Host link seconds of the step: each stage's busiest GPU's, total over stages and replicas."""
        return sum(e.copy_s for lane in self.copy_lanes().values() for e in lane)

    @property
    def host_copy_exposed_s(self) -> float:
        """Exposed seconds of the busiest GPUs' host copy chains, total over stages and replicas."""
        return sum(e.exposed_s for lane in self.copy_lanes().values() for e in lane)

    def copy_lanes(self) -> dict[tuple[int, int], list[CopyEvent]]:
        """(dp_rank, stage) -> the copy events of that stage's busiest GPU (the most link seconds), in
        time order: with elastic SP rounds a stage's GPUs run different units, each its own copies."""
        stages: dict[tuple[int, int], list[CopyEvent]] = {}
        for e in sorted(self.copy_events, key=lambda e: e.start_s):
            stages.setdefault((e.dp_rank, e.stage), []).append(e)
        return {key: _busiest_gpu(events) for key, events in stages.items()}

    def copy_totals(self) -> dict:
        """The host copy keys of ``to_dict`` and the planner's JSON: totals over stages and replicas
        (link seconds, exposed seconds, bytes, host CPU seconds on the chains) and, per stage, the
        busiest replica's link and exposed seconds; empty without host copies (no keys)."""
        if not self.copy_events:
            return {}
        stages = len(self.peak_memory_bytes)
        lanes = self.copy_lanes()
        per = {key: (sum(e.copy_s for e in lane), sum(e.exposed_s for e in lane)) for key, lane in lanes.items()}
        events = [e for lane in lanes.values() for e in lane]
        return {"host_copy_s": sum(e.copy_s for e in events), "host_copy_exposed_s": sum(e.exposed_s for e in events),
                "host_copy_bytes": sum(e.bytes for e in events), "host_copy_cpu_s": sum(e.cpu_s for e in events),
                "host_copy_s_per_stage": [max((v[0] for (_, s), v in per.items() if s == st), default=0.0)
                                          for st in range(stages)],
                "host_copy_exposed_s_per_stage": [max((v[1] for (_, s), v in per.items() if s == st),
                                                      default=0.0) for st in range(stages)]}

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
            **self.copy_totals(),
        }
        if include_events:
            d["events"] = [asdict(e) for e in self.events]
            d["memory_timeline"] = {f"{r},{s}": [list(p) for p in pts]
                                    for (r, s), pts in sorted(self.memory_timeline.items())}
            if self.copy_events:
                d["copy_events"] = [asdict(e) for e in self.copy_events]
        return d


def _busiest_gpu(events: list[CopyEvent]) -> list[CopyEvent]:
    """The events one GPU of a stage runs, for the GPU with the most link seconds (``events``: the
    stage's, whole-group ones on every GPU)."""
    ranks = sorted({r for e in events if e.sub_group is not None for r in range(*_span(e.sub_group))})
    if not ranks:
        return list(events)
    lanes = [[e for e in events if e.on_rank(r)] for r in ranks]
    return max(lanes, key=lambda lane: sum(e.copy_s for e in lane))


def _span(sub_group: tuple[int, int]) -> tuple[int, int]:
    """``(first rank, one past the last)`` of an ``(offset, size)`` sub-group."""
    return sub_group[0], sub_group[0] + sub_group[1]
