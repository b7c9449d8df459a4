"""The one search loop: try a schedule's candidates for one batch, keep the fastest that fits.

For each candidate: build its plan (a ``ValueError`` records the knobs as infeasible with the
error), ``reject`` it or not, simulate, ``refine``, record; the fastest feasible plan wins, the
first on ties.  A candidate's record is the schedule's (knob values, feasibility, step time, ...);
stopping early and pruning are the schedule's candidate generator reading the state.
"""
from __future__ import annotations

from infinipipe_hf.planner.schedules.base import Knobs, Schedule, SearchState


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


def _fail(state: SearchState, knobs: Knobs, error: str) -> None:
    state.last_error = error
    state.tried.append({**knobs.record(), "feasible": False, "error": error})
