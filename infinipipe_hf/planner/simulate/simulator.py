"""Simulator: replay a plan with the cost model for step time, bubbles, recompute and memory.

Design: each DP replica is replayed on its own (:func:`.replay.replay`): a stage runs its action
list in order, a forward waits for the previous stage's forward of the unit plus the transfer, a
backward for the next stage's backward (on the last stage its own forward); durations are
``cost.compute.forward_time`` / ``cost.backward_time`` with the plan's checkpointed-layer counts (the
backward includes the recompute, of whole layers and of the finer levels inside layers).  Replicas
run in parallel, so the step ends with the slowest.  A stage's step ends after its last
action plus the exposed part of the step's gradient reduction (``cost.compute.gradient_sync_time``: the
all-reduce over SP x DP ranks, or FSDP2's reduce-scatters behind the last backward; zero for a
stage of one GPU in one replica), then, with optimizer states in host memory, the exposed CPU
optimizer step (``cost.state_host.step_tail_s``: gradients down, AdamW, weights up).  All times
are per GPU: with sequence parallelism a stage is a group of GPUs working on each unit in lockstep.
With a host tier each stage also gets a copy lane (:mod:`.copy_lane`): what its actions copy
between host and device and the exposed part, which the durations above already include.
Memory per action comes from the stage's memory timeline
(:mod:`infinipipe_hf.planner.checkpointing.memory_walk`, the same points the checkpoint solver
constrains), so simulator, solver and validator agree on what "fits" means.

Extension point: a cost model with a ``replica_replay(plan, costs, lists)`` method (``costs``:
the :class:`.action_costs.ActionCosts`, ``lists``: replica -> stage action lists; it returns
replica -> :class:`.replay.ReplayResult`) replays all replicas together instead, for runs whose
ranks share hardware, such as several CPU ranks on a few cores, where actions running at once
slow each other down.

Trade-off: the memory timeline records each action's *peak* from its start until the next
action starts; idle gaps therefore show the previous peak rather than the lower resident level.
That is conservative and is what decides feasibility; the exact shape between peaks is not
modelled.  SP rounds (:mod:`.sp_round_steps`): a stage's round is replayed as one step lasting as
long as its slowest unit, and memory is the busiest SP rank's.  Communication is a pure delay
(no contention, sends never block compute); a replica replay on shared hardware may also charge a
message's CPU to its two ends (``ActionCosts.shared_work``, ``p2p_cpu_s``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import has_sub_groups
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.simulate.action_costs import ActionCosts
from infinipipe_hf.planner.simulate.copy_lane import CopyLane
from infinipipe_hf.planner.simulate.replay import ReplayResult, replay
from infinipipe_hf.planner.simulate.result import ActionEvent, CopyEvent, SimulationResult
from infinipipe_hf.planner.simulate.sp_round_steps import RoundSteps


class PlanDeadlockError(ValueError):
    """The plan's action lists cannot all run: some stage waits forever (run the validator)."""


@dataclass
class _Totals:
    """What :func:`simulate` accumulates over replicas, stages and actions, in that order."""

    peaks: list[float]
    lane: CopyLane
    events: list[ActionEvent] = field(default_factory=list)
    copies: list[CopyEvent] = field(default_factory=list)
    timeline: dict[tuple[int, int], list[tuple[float, float]]] = field(default_factory=dict)
    busy: float = 0.0
    step: float = 0.0
    recompute: float = 0.0
    sync: float = 0.0
    tail: float = 0.0
    memory: bool = True
    """Whether memory is walked (``simulate``'s ``memory``)."""


def simulate(plan: Plan, cost: CostModel, memory: bool = True) -> SimulationResult:
    """Replay ``plan`` under ``cost`` (as the plan was priced: :meth:`CostModel.for_plan`); raises
    :class:`PlanDeadlockError` if it cannot complete.  ``memory=False`` times the plan alone (a
    bound's replay): no memory walk, peaks 0 and ``feasible`` False."""
    cost = cost.for_plan(plan) if hasattr(cost, "for_plan") else cost  # test doubles lack it
    _check_cost(plan, cost)
    steps = RoundSteps(plan) if has_sub_groups(plan) else None
    costs = ActionCosts(plan, cost, steps)
    p = plan.pp_degree
    totals = _Totals([0.0] * p, CopyLane(plan, cost, costs), memory=memory)
    replicas = sorted(plan.actions)
    lists = {r: plan.actions[r] if steps is None else steps.lists[r] for r in replicas}
    joint = _replica_replays(plan, cost, costs, lists)
    for r in replicas:
        stage_actions = lists[r]
        rep = joint[r] if joint is not None else replay(stage_actions, costs.duration, costs.transfer)
        if not rep.complete:
            stuck = ", ".join(f"stage {s} at {stage_actions[s][i]} (#{i})" for s, i in rep.stuck(stage_actions))
            raise PlanDeadlockError(f"dp replica {r} deadlocks: {stuck} wait forever; run "
                                    f"validate(plan) for the stage-by-time grid")
        if steps is None:
            _add_replica(plan, cost, costs, r, rep, totals)
        else:
            _add_round_replica(plan, cost, costs, steps, r, rep, totals)
    step = totals.step
    capacity = step * p * plan.dp_degree
    bubble = 1.0 - totals.busy / capacity if capacity > 0 else 0.0
    budget = float(cost.memory_budget_bytes)
    return SimulationResult(
        step_time_s=step,
        tokens_per_s=plan.num_tokens / step if step > 0 else 0.0,
        bubble_fraction=max(0.0, bubble),
        peak_memory_bytes=totals.peaks,
        memory_budget_bytes=budget,
        recompute_time_s=totals.recompute,
        events=totals.events,
        memory_timeline=totals.timeline,
        feasible=memory and all(x <= budget for x in totals.peaks),
        info={"num_pipelines": plan.num_pipelines, "num_units": len(plan.units),
              **({"gradient_sync_s": totals.sync} if totals.sync else {}),
              **({"state_step_tail_s": totals.tail} if totals.tail else {})},
        recompute_fraction=totals.recompute / capacity if capacity > 0 else 0.0,
        copy_events=totals.copies,
    )


def _check_cost(plan: Plan, cost: CostModel) -> None:
    """``ValueError`` unless ``cost`` was built for the plan's pp, sp and shard layout."""
    dims = cost.dims
    got, want = (dims.pp_degree, dims.sp_degree, dims.shard), (plan.pp_degree, plan.sp_degree, plan.shard)
    if got != want:
        raise ValueError(f"cost model has pp_degree={got[0]}, sp_degree={got[1]}, shard={got[2].name!r} but the plan has "
                         f"pp_degree={want[0]}, sp_degree={want[1]}, shard={want[2].name!r}; build the CostModel on the "
                         f"plan's layout")


def _replica_replays(plan: Plan, cost: CostModel, costs: ActionCosts,
                     lists: dict[int, list]) -> dict[int, ReplayResult] | None:
    """The cost model's ``replica_replay`` of every replica's stage lists ``lists`` (module
    docstring), or None when it has none (each replica then replays on its own devices)."""
    joint = getattr(cost, "replica_replay", None)
    if joint is None:
        return None
    reps = joint(plan, costs, lists)
    missing = sorted(set(lists) - set(reps))
    if missing:
        raise ValueError(f"{type(cost).__name__}.replica_replay returned no replay for dp replicas {missing}; "
                         f"it must return one ReplayResult per replica of the plan")
    return reps


def _add_replica(plan: Plan, cost: CostModel, costs: ActionCosts, r: int, rep: ReplayResult,
                 totals: _Totals) -> None:
    """Add replica ``r``'s events, busy and recompute time, step end and memory to ``totals``."""
    for s, acts in enumerate(plan.actions[r]):
        for i, a in enumerate(acts):
            rec = 0.0 if a.is_forward else costs.recompute(s, a.unit)
            totals.recompute += rec
            totals.busy += rep.end[s][i] - rep.start[s][i]
            totals.events.append(ActionEvent(r, s, str(a), rep.start[s][i], rep.end[s][i], rec))
            _add_copy(totals, totals.lane.action_event(r, s, a, rep.start[s][i]))
        _stage_end(cost, r, rep, s, acts, totals)
        if totals.memory:
            _add_memory(cost, r, s, rep, stage_point_values(plan, cost, r, s), totals)


def _add_round_replica(plan: Plan, cost: CostModel, costs: ActionCosts, steps: RoundSteps, r: int,
                       rep: ReplayResult, totals: _Totals) -> None:
    """:func:`_add_replica` of a plan with SP rounds, replayed by steps (:mod:`.sp_round_steps`): an
    event per unit, busy time by each unit's share of the stage's ranks, a round's recompute its
    slowest unit's, memory the busiest rank's."""
    for s, acts in enumerate(steps.lists[r]):
        for i in range(len(acts)):
            worst = 0.0
            for a, start, end, share in steps.unit_events(r, s, i, rep.start[s][i], rep.end[s][i], costs.unit_duration):
                rec = 0.0 if a.is_forward else costs.recompute(s, a.unit)
                worst = max(worst, rec)
                totals.busy += share * (end - start)
                totals.events.append(ActionEvent(r, s, str(a), start, end, rec))
                _add_copy(totals, totals.lane.action_event(r, s, a, start))
            totals.recompute += worst
        _stage_end(cost, r, rep, s, acts, totals)
        if not totals.memory:
            continue
        cache: dict = {}
        per_rank = [stage_point_values(view, cost, r, s, cache) for view in steps.views]
        _add_memory(cost, r, s, rep, [max(vs) for vs in zip(*per_rank)], totals)


def _add_copy(totals: _Totals, event: CopyEvent | None) -> None:
    if event is not None:
        totals.copies.append(event)


def _stage_end(cost: CostModel, r: int, rep: ReplayResult, s: int, acts: list, totals: _Totals) -> None:
    """The stage's end: its last action plus the exposed part of the step's gradient reduction and
    of an optimizer step in host memory (and the copy event of what that end holds)."""
    if not acts:
        return
    sync_time = getattr(cost.compute, "gradient_sync_time", None)
    state_host = getattr(cost, "state_host", None)  # stand-in cost models in tests carry none
    end = rep.end[s][-1]
    tail = 0.0
    last_b = max((i for i, a in enumerate(acts) if not a.is_forward), default=None)
    if last_b is not None and sync_time is not None:
        sync = sync_time(s, rep.end[s][last_b] - rep.start[s][last_b])
        if sync:
            end += sync
            totals.sync = max(totals.sync, sync)
    if last_b is not None and state_host is not None:
        tail = state_host.step_tail_s(s)
        if tail:
            totals.tail = max(totals.tail, tail)
    if last_b is not None:
        _add_copy(totals, totals.lane.step_event(r, s, end, tail))
    totals.step = max(totals.step, end + tail)


def _add_memory(cost: CostModel, r: int, s: int, rep: ReplayResult, values: list[float], totals: _Totals) -> None:
    totals.timeline[(r, s)] = [(rep.start[s][i], v) for i, v in enumerate(values)]
    totals.peaks[s] = max(totals.peaks[s], max(values, default=cost.acts.static_bytes(s)))


def stage_point_values(plan: Plan, cost: CostModel, dp_rank: int, stage: int, cache: dict | None = None) -> list[float]:
    """``points.point_bytes`` of every point of the stage (the array timeline: a cumulative sum of
    live activations, bit-identical to summing each point's live set; see
    tests/planner/checkpointing/test_memory_walk.py)."""
    ck = plan.checkpoint_layers.get(stage, {})
    levels = plan.checkpoint_levels.get(stage, {})
    return stage_timeline(plan, cost, dp_rank, stage, cache).point_values(cost, stage, ck, levels).tolist()
