"""The one search loop: try a schedule's candidates for one batch, keep the fastest that fits.

For each candidate: build its plan (a ``ValueError`` records the knobs as infeasible with the
error), ``reject`` it or not, simulate, ``refine``, record; the fastest feasible plan wins, the
first on ties.  A candidate's record is the schedule's (knob values, feasibility, step time, ...);
stopping early and pruning are the schedule's candidate generator reading the state.
"""
from __future__ import annotations

import time

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.registry import SCHEDULES
from infinipipe_hf.planner.schedules.base import ROUNDS, Knobs, Schedule, SearchState
from infinipipe_hf.planner.search.result import PlanResult


def run_search(schedule: Schedule, ctx) -> SearchState:
    """Every candidate ``schedule`` offers for the batch in ``ctx``; the state holds the best."""
    state = SearchState()
    for candidate in schedule.candidates(ctx, state):
        state.last = None
        try:
            plan = candidate.build()
        except ValueError as exc:  # a knob value that cannot hold some sequence
            _fail(state, candidate.knobs, str(exc))
            continue
        why = schedule.reject(plan, candidate.knobs, ctx)
        if why is not None:
            _fail(state, candidate.knobs, why)
            continue
        sim = schedule.simulate(plan, ctx)
        plan, sim = schedule.refine(plan, sim, candidate.knobs, ctx)
        state.tried.append(schedule.record(candidate.knobs, plan, sim))
        state.last = sim
        if not sim.feasible:
            error = schedule.infeasible_error(sim)
            if error is not None:
                state.last_error = error
        else:
            state.offer(plan, sim, candidate.knobs.family)
    return state


def plan_rounds(schedule: str, lengths: list[int], cost: FlatCost, *, checkpointing: str | int = "adaptive",
                **knobs) -> PlanResult:
    """The fastest plan of the non-pipeline ``schedule`` for one batch on ``cost`` (no input checks
    beyond the schedule's own)."""
    t0 = time.perf_counter()
    sched = SCHEDULES[schedule]
    assert sched.kind == ROUNDS, schedule
    ctx = sched.context(lengths, cost, checkpointing, **knobs)
    state = run_search(sched, ctx)
    elapsed = time.perf_counter() - t0
    if state.best is None:
        error = sched.infeasible_message(ctx, state.last_error)
        return PlanResult(schedule, None, None, False, error, elapsed, state.tried, world_size=cost.world_size)
    plan, sim = state.best
    return PlanResult(schedule, plan, sim, True, None, elapsed, state.tried, world_size=cost.world_size)


def _fail(state: SearchState, knobs: Knobs, error: str) -> None:
    state.last_error = error
    state.tried.append({**knobs.record(), "feasible": False, "error": error})
