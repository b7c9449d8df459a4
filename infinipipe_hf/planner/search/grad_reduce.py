"""The planner's choice of when a sharded stage reduces its gradients (``ir.grad_reduce``).

``auto`` plans the step both ways where ``unit`` can run (the shard group spans SP ranks only,
:func:`~infinipipe_hf.ir.grad_reduce.unit_reduce_problem`) and keeps the faster feasible plan as
simulated: ``step`` holds every unsharded fp32 gradient through the step (more recompute, or no
fit, where memory is tight) but pays one reduce-scatter per layer per step; ``unit`` frees them
after each backward for a reduce-scatter per unit and layer (slower on many small units).  Both
are priced by the same cost model (``CostModel(grad_reduce=...)``), so the pick is the
simulator's, not a rule of thumb.  ``unit`` is planned first and ``step`` runs under its step
(``plan_step``'s ``beat_step_s``): a ``step`` search that provably cannot be faster stops early.
The plan records the pick (``Plan.grad_reduce``); the runtime follows the plan.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

from infinipipe_hf.ir.grad_reduce import check_grad_reduce, unit_reduce_problem
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.search.result import PlanResult


def reduce_modes(asked: str, cost: CostModel) -> tuple[str, ...]:
    """The modes to plan for ``asked`` on ``cost``'s layout.  ``auto``: both where ``unit`` runs
    and ``cost`` was built with the default ``step``; else ``cost``'s own (a cost built with
    ``unit`` on a layout that cannot run it stays a what-if).  ``ValueError`` when ``unit`` is
    asked for a layout that cannot run it."""
    check_grad_reduce(asked)
    problem = unit_reduce_problem(cost.dims)
    if asked == "auto":
        own = cost.ctx.grad_reduce
        return ("step", "unit") if problem is None and own == "step" else (own,)
    if asked == "unit" and problem is not None:
        raise ValueError(f"{problem} (layout {cost.dims.label})")
    return (asked,)


def with_reduce(cost: CostModel, mode: str) -> CostModel:
    """``cost`` priced with ``grad_reduce=mode`` (itself when it already is)."""
    if cost.ctx.grad_reduce == mode:
        return cost
    return CostModel.of_context(dataclasses.replace(cost.ctx, grad_reduce=mode))  # also unsharded (bounds)


def leanest_reduce(cost: CostModel, asked: str) -> CostModel:
    """``cost`` with the gradient reduction of the fewest model states of those :func:`reduce_modes`
    plans for ``asked`` (per unit where ``auto`` can run it)."""
    return with_reduce(cost, reduce_modes(asked, cost)[-1])


def faster(a: PlanResult, b: PlanResult) -> PlanResult:
    """The feasible result with the shorter simulated step (``a`` on ties or when neither fits)."""
    if a.feasible != b.feasible:
        return a if a.feasible else b
    if not a.feasible:
        return a
    return b if b.simulation.step_time_s < a.simulation.step_time_s else a


def plan_each_reduce(plan_one: Callable[[str, CostModel, float | None], PlanResult], cost: CostModel,
                     modes: tuple[str, ...], t0: float, beat_step_s: float | None = None) -> PlanResult:
    """Plan with each of ``modes`` (``plan_one(mode, cost, beat_step_s)``) and keep the faster; the
    result's planning time covers all of them and its plan's ``info["grad_reduce_tried"]`` lists
    each mode's simulated step time (``None``: no plan fit).  Modes are planned last first, each under
    the least of the caller's ``beat_step_s`` and the steps already planned (a later plan is kept
    only when strictly faster, so ties still go to the first mode).  A mode ``plan_one`` stops
    short of that step (``PlanResult.beaten_bound_s``) is left out; when no other mode's plan runs
    under its bound the result is that stopped one, bounded by the least step of them all."""
    results: dict[str, PlanResult] = {}
    for mode in reversed(modes):  # per unit first: its step may stop the per-step search early
        beats = [] if beat_step_s is None else [beat_step_s]
        beats += [math.nextafter(r.simulation.step_time_s, math.inf) for r in results.values()
                  if r.beaten_bound_s is None and r.feasible]  # kept only when strictly faster
        results[mode] = plan_one(mode, with_reduce(cost, mode), min(beats, default=None))
    results = {mode: results[mode] for mode in modes}  # ties go to the first mode, as always
    planned = [r for r in results.values() if r.beaten_bound_s is None]
    best = planned[0] if planned else None
    for r in planned[1:]:
        best = faster(best, r)
    floor = min((r.beaten_bound_s for r in results.values() if r.beaten_bound_s is not None), default=None)
    if floor is not None and not (best is not None and best.feasible and best.simulation.step_time_s < floor):
        # A mode stopped by the caller's step, and no other mode's plan beats its bound: the step
        # the full search would return is at least the least of them all.
        best = next(r for r in results.values() if r.beaten_bound_s is not None)
        best.beaten_bound_s = min([floor] + [r.simulation.step_time_s for r in planned if r.feasible])
    best.planning_time_s = time.perf_counter() - t0
    if best.plan is not None and len(planned) > 1:
        best.plan.info["grad_reduce_tried"] = {
            m: (r.simulation.step_time_s if r.feasible else None) for m, r in results.items()}
    return best


def plans_otherwise(asked: str, planned, layout) -> bool:
    """Whether ``layout`` may plan otherwise than the outcome ``planned`` of a layout priced alike
    (the layout search's pricing key) because only one of them can reduce gradients per unit
    (``sp`` but not ``hybrid`` across DP replicas)."""
    if asked == "step":
        return False
    here, there = unit_reduce_problem(layout) is None, unit_reduce_problem(planned.layout) is None
    if planned.result is None:  # ruled out (alike for both), or pruned by a bound of its own modes only
        return here and not there and getattr(planned, "bound_step_time_s", None) is not None
    shared = getattr(planned.result.plan, "grad_reduce", "step")
    return here != there and not (shared == "step" and not here)
