"""Simulator: replay a plan with the cost model for step time, bubbles, recompute and memory.

Design: each DP replica is replayed on its own (:func:`replay.replay`): a stage runs its action
list in order, a forward waits for the previous stage's forward of the unit plus the transfer, a
backward for the next stage's backward (on the last stage its own forward); durations are
``cost.forward_time`` / ``cost.backward_time`` with the plan's checkpointed-layer counts (the
backward includes the recompute, of whole layers and of the finer levels inside layers).  Replicas
run in parallel, so the step ends with the slowest.  A stage's step ends after its last
action plus the exposed part of the step's gradient reduction (``cost.gradient_sync_time``: the
all-reduce over SP x DP ranks, or FSDP2's reduce-scatters behind the last backward; zero for a
stage of one GPU in one replica).  All times are per GPU: with sequence parallelism a stage is
a group of GPUs working on each unit in lockstep.
Memory per action comes from :mod:`memory` (the same points the checkpoint solver constrains), so
simulator, solver and validator agree on what "fits" means.

When the profile says the ranks share a few cores (``HardwareProfile.shared_cores``, CPU runs)
the replicas are replayed together with processor sharing (:mod:`shared_replay`): durations are
then work at full speed, stretched while more ranks compute than there are cores (or, with
``pinned_ranks``, than the ranks pinned to the same core).

Trade-off: the memory timeline records each action's *peak* from its start until the next
action starts; idle gaps therefore show the previous peak rather than the lower resident level.
That is conservative and is what decides feasibility; the exact shape between peaks is not
modelled.  Communication is a pure delay (no contention, sends never block compute); only on
shared cores does a message also cost CPU there (``p2p_cpu_s``: gloo's threads copy the bytes).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.planner.cost.model import CostModel, UnitShape
from infinipipe_hf.planner.checkpointing.timeline import stage_timeline
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.simulate.replay import replay
from infinipipe_hf.planner.simulate.shared_replay import shared_replay


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


class ActionCosts:
    """What the replay charges each action of ``plan``: its compute (``duration``: the cost
    model's forward or backward with the plan's checkpointing), the delay of its input
    (``transfer``), and on shared cores its work there (``shared_work``: the compute plus its share
    of the CPU its point-to-point messages cost, half of each message it sends or receives)."""

    def __init__(self, plan: Plan, cost: CostModel) -> None:
        self.plan, self.cost = plan, cost
        self.shapes = {u.id: UnitShape.of(u.segments) for u in plan.units}
        self.tokens = {u.id: u.num_tokens for u in plan.units}

    def _shape(self, uid: int) -> UnitShape:
        if uid not in self.shapes:
            raise ValueError(f"an action names unit {uid}, which is not among the plan's units; "
                             f"validate the plan (infinipipe_hf.planner.simulate.validator.validate)")
        return self.shapes[uid]

    def duration(self, stage: int, a: Action) -> float:
        shape = self._shape(a.unit)
        if a.is_forward:
            return self.cost.forward_time(stage, shape)
        t = self.cost.backward_time(stage, shape, self.plan.checkpointed(stage, a.unit))
        return t + self.finer_recompute(stage, a.unit)

    def finer_recompute(self, stage: int, uid: int) -> float:
        finer = self.plan.checkpoint_levels.get(stage, {}).get(uid)
        return self.cost.levels.finer_recompute_s(self.shapes[uid], CheckpointMix.of(0, finer)) if finer else 0.0

    def transfer(self, a: Action) -> float:
        self._shape(a.unit)
        return self.cost.transfer_time(self.tokens[a.unit])

    def message_cpu(self, stage: int, a: Action) -> float:
        """This action's half of the CPU of the messages it receives and sends (a forward receives
        from the previous stage and sends to the next, a backward the other way round)."""
        messages = (stage > 0) + (stage < self.plan.pp_degree - 1)
        return 0.5 * messages * self.cost.message_cpu_time(self.tokens[a.unit])

    def shared_work(self, stage: int, a: Action) -> float:
        return self.duration(stage, a) + self.message_cpu(stage, a)


class PlanDeadlockError(ValueError):
    """The plan's action lists cannot all run: some stage waits forever (run the validator)."""


def simulate(plan: Plan, cost: CostModel) -> SimulationResult:
    """Replay ``plan`` under ``cost``; raises :class:`PlanDeadlockError` if it cannot complete."""
    if cost.pp_degree != plan.pp_degree:
        raise ValueError(f"cost model has pp_degree={cost.pp_degree} but the plan has {plan.pp_degree}; "
                         f"build the CostModel with pp_degree={plan.pp_degree}")
    # Cost models without a layout (duck-typed test doubles) are single-GPU stages, unsharded.
    cost_layout = (getattr(cost, "sp_degree", 1), getattr(cost, "shard", "none"))
    sync_time = getattr(cost, "gradient_sync_time", None)
    if cost_layout != (plan.sp_degree, plan.shard):
        raise ValueError(f"cost model has sp_degree={cost_layout[0]}, shard={cost_layout[1]!r} but the plan "
                         f"has sp_degree={plan.sp_degree}, shard={plan.shard!r}; build the CostModel "
                         f"with the plan's sp_degree and shard")
    costs = ActionCosts(plan, cost)
    shapes = costs.shapes
    p = plan.pp_degree
    events: list[ActionEvent] = []
    timeline: dict[tuple[int, int], list[tuple[float, float]]] = {}
    peaks = [0.0] * p
    busy = 0.0
    step = 0.0
    recompute_total = 0.0
    sync_total = 0.0
    finer_recompute = costs.finer_recompute

    replicas = sorted(plan.actions)
    profile = getattr(cost, "profile", None)
    cores = float(getattr(profile, "shared_cores", 0.0) or 0.0)
    shared = (dict(zip(replicas, shared_replay([plan.actions[r] for r in replicas], costs.shared_work,
                                               costs.transfer, cores=cores, ranks_per_stage=plan.sp_degree,
                                               pinned=bool(getattr(profile, "pinned_ranks", False)))))
              if cores else None)
    for r in replicas:
        stage_actions = plan.actions[r]
        rep = shared[r] if shared is not None else replay(stage_actions, costs.duration, costs.transfer)
        if not rep.complete:
            stuck = ", ".join(f"stage {s} at {stage_actions[s][i]} (#{i})" for s, i in rep.stuck(stage_actions))
            raise PlanDeadlockError(f"dp replica {r} deadlocks: {stuck} wait forever; run "
                                    f"validate(plan) for the stage-by-time grid")
        for s, acts in enumerate(stage_actions):
            for i, a in enumerate(acts):
                rec = 0.0 if a.is_forward else (
                    cost.recompute_time(s, shapes[a.unit], plan.checkpointed(s, a.unit)) + finer_recompute(s, a.unit))
                recompute_total += rec
                busy += rep.end[s][i] - rep.start[s][i]
                events.append(ActionEvent(r, s, str(a), rep.start[s][i], rep.end[s][i], rec))
            if acts:
                end = rep.end[s][-1]
                last_b = max((i for i, a in enumerate(acts) if not a.is_forward), default=None)
                if last_b is not None and sync_time is not None:
                    sync = sync_time(s, rep.end[s][last_b] - rep.start[s][last_b])
                    if sync:
                        end += sync
                        sync_total = max(sync_total, sync)
                step = max(step, end)
            values = _point_values(plan, cost, r, s)
            timeline[(r, s)] = [(rep.start[s][i], v) for i, v in enumerate(values)]
            peaks[s] = max(peaks[s], max(values, default=cost.static_bytes(s)))
    capacity = step * p * plan.dp_degree
    bubble = 1.0 - busy / capacity if capacity > 0 else 0.0
    budget = float(cost.memory_budget_bytes)
    return SimulationResult(
        step_time_s=step,
        tokens_per_s=plan.num_tokens / step if step > 0 else 0.0,
        bubble_fraction=max(0.0, bubble),
        peak_memory_bytes=peaks,
        memory_budget_bytes=budget,
        recompute_time_s=recompute_total,
        events=events,
        memory_timeline=timeline,
        feasible=all(x <= budget for x in peaks),
        info={"num_pipelines": plan.num_pipelines, "num_units": len(plan.units),
              **({"gradient_sync_s": sync_total} if sync_total else {})},
        recompute_fraction=recompute_total / capacity if capacity > 0 else 0.0,
    )


def _point_values(plan: Plan, cost: CostModel, dp_rank: int, stage: int) -> list[float]:
    """``memory.point_bytes`` of every point of the stage (the array timeline: a cumulative sum of
    live activations, bit-identical to summing each point's live set, tested in test_memory.py)."""
    ck = plan.checkpoint_layers.get(stage, {})
    levels = plan.checkpoint_levels.get(stage, {})
    return stage_timeline(plan, cost, dp_rank, stage).point_values(cost, stage, ck, levels).tolist()
