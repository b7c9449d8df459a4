"""Planning the layouts of a search most promising first, skipping those proven bounds rule out.

Each distinct layout gets a lower bound of the step time ``plan_step`` would return for it
(:func:`~.bound.step_time_bound`: its compute alone), so an upper bound of its tokens/s.  Layouts
are planned by that bound, best first; once a planned layout fits at ``x`` tokens/s, a layout whose
upper bound is below ``x`` cannot be the pick (nor tie with it: ``PRUNE_MARGIN`` is wider than the
pick's tie tolerance) and is reported as pruned instead of planned.  A layout that is planned gets
the best step so far (``plan_step``'s ``beat_step_s``): its search stops before solving any
checkpointing when every candidate it may plan, replayed with nothing recomputed (bubbles and
communication included), is no faster, and it is reported as pruned with that bound (``basis``
``candidates``); after its candidates are planned, it stops before the final solve when every
finalist, replayed with nothing recomputed or copied to host memory, is no faster (``basis``
``finalists``): candidates whose plans need much recompute are no longer among them.  The pick
therefore equals the exhaustive search's; only the pruned layouts' own figures are missing (their
bound is shown).

With ``workers > 1`` the layouts go to a spawned process pool in the same order, at most
``workers`` in flight; a layout is pruned against the best outcome finished when its turn comes,
so which layouts are pruned can vary with timing, the pick cannot.

Layouts the search rules out before planning (a replica without sequences, model states over the
budget, the longest sequence not fitting alone) are never pruned: their own reason says more.
Trade-off: the compute bound ignores recompute, bubbles and communication, so it prunes layouts
whose pure compute is slower (deep pipelines with an LM-head stage, replicas holding the longest
documents); the candidates' bound costs a replay per candidate, a fraction of planning them.
"""
from __future__ import annotations

import multiprocessing
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable, Sequence

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.layout_search.bound import step_time_bound
from infinipipe_hf.planner.layout_search.longest import fits_alone, leanest_cost
from infinipipe_hf.planner.layout_search.result import LayoutOutcome
from infinipipe_hf.planner.search.limits import states_per_gpu

PRUNE_MARGIN = 1e-6
"""A layout is pruned when its tokens/s bound is below the best planned times ``1 - PRUNE_MARGIN``
(the pick's tie tolerance is 1e-9, so a pruned layout could not even tie)."""


@dataclass
class PrunedOutcome(LayoutOutcome):
    """A layout not planned: its proven tokens/s bound is below a planned layout's tokens/s."""

    bound_step_time_s: float = 0.0
    """Lower bound of the step time ``plan_step`` would return (:mod:`.bound`)."""
    bound_tokens_per_s: float = 0.0
    """The batch's tokens over ``bound_step_time_s``: more than the layout can reach."""
    beaten_by: str = ""
    """The planned layout whose tokens/s the bound is below."""
    beaten_tokens_per_s: float = 0.0
    basis: str = "compute"
    """What the bound counts: ``compute`` (its compute alone, before planning), ``candidates``
    (every candidate's units simulated without recompute, the planning's last step skipped) or
    ``finalists`` (its planned finalists' units simulated with nothing recomputed or copied to host
    memory, the final solve skipped)."""

    @property
    def error(self) -> str | None:
        what = {"compute": "its compute alone, no bubbles, recompute or communication",
                "candidates": "its best candidate's units with bubbles and communication, without recompute",
                "finalists": "its planned finalists with nothing recomputed or copied to host memory"}[self.basis]
        return (f"not planned in full: at most {self.bound_tokens_per_s:,.0f} tokens/s (a step of at least "
                f"{self.bound_step_time_s:.4g} s: {what}) < {self.beaten_tokens_per_s:,.0f} tokens/s planned on "
                f"{self.beaten_by}")

    def pruned_dict(self) -> dict:
        """The ``pruned`` entry of this layout in the search's JSON."""
        return {"bound_step_time_s": self.bound_step_time_s, "bound_tokens_per_s": self.bound_tokens_per_s,
                "beaten_by": self.beaten_by, "beaten_tokens_per_s": self.beaten_tokens_per_s, "basis": self.basis,
                "reason": self.error}

    def to_dict(self) -> dict:
        return {**super().to_dict(), "pruned": self.pruned_dict()}


def bound_of(inputs, layout: ParallelDims) -> float:
    """Lower bound of the layout's step time; 0.0 for layouts the search rules out at once (a replica
    without sequences, states over the budget: never pruned, ``search._plan_fed_layout`` says why)."""
    if len(inputs.lengths) < layout.dp_degree:
        return 0.0
    cost = inputs.cost(layout)
    if states_per_gpu(cost) > inputs.memory_budget_bytes:
        return 0.0
    return step_time_bound(inputs.lengths, cost, inputs.plan_options.get("sp_rounds"))


def _pruned(inputs, layout: ParallelDims, bound: float, best: LayoutOutcome, took_s: float) -> PrunedOutcome | None:
    """The pruned outcome of ``layout`` when its bound (found in ``took_s`` seconds) cannot beat
    ``best``, else None."""
    if best is None or bound <= 0:
        return None
    ceiling = sum(inputs.lengths) / bound
    if ceiling >= best.tokens_per_s * (1 - PRUNE_MARGIN):
        return None
    if not inputs.host_budget_bytes and not fits_alone(leanest_cost(inputs, layout), max(inputs.lengths),
                                                       inputs.plan_options.get("num_slices")):
        return None  # ruled out when planned, which says why (the check costs a plan of one sequence)
    return pruned_by(inputs, layout, bound, best, took_s, "compute")


def pruned_by(inputs, layout: ParallelDims, bound: float, best: LayoutOutcome, took_s: float,
              basis: str) -> PrunedOutcome:
    """``layout`` pruned: its step is at least ``bound`` seconds (by ``basis``), slower than ``best``."""
    return PrunedOutcome(layout, None, None, took_s, bound_step_time_s=bound, basis=basis,
                         bound_tokens_per_s=sum(inputs.lengths) / bound,
                         beaten_by=f"{best.layout.label} shard {best.layout.shard}",
                         beaten_tokens_per_s=best.tokens_per_s)


def beat_step_s(inputs, best: LayoutOutcome | None) -> float | None:
    """The step a layout planned now must run under to be pruned by nothing (:data:`PRUNE_MARGIN`
    of the best planned tokens/s), for ``plan_step``'s ``beat_step_s``; None before any fits."""
    if best is None:
        return None
    return sum(inputs.lengths) / (best.tokens_per_s * (1 - PRUNE_MARGIN))


def stopped(inputs, outcome: LayoutOutcome, best: LayoutOutcome | None) -> LayoutOutcome:
    """``outcome``, or its :class:`PrunedOutcome` when its planning stopped short of ``best``'s step
    (``PlanResult.beaten_bound_s``: the candidates' or the finalists' bound)."""
    bound = getattr(outcome.result, "beaten_bound_s", None)
    if bound is None or best is None:
        return outcome
    return pruned_by(inputs, outcome.layout, bound, best, outcome.search_time_s, outcome.result.beaten_basis)


def _better(best: LayoutOutcome | None, outcome: LayoutOutcome) -> LayoutOutcome | None:
    if outcome.feasible and (best is None or outcome.tokens_per_s > best.tokens_per_s):
        return outcome
    return best


def plan_pruned(inputs, todo: Sequence[ParallelDims], plan_one: Callable, workers: int,
                prune: bool) -> list[LayoutOutcome]:
    """Each of ``todo``'s outcomes, in its order: planned with ``plan_one(inputs, layout)`` best bound
    first, or pruned (module docstring); ``workers`` > 1 plans in a spawned process pool."""
    bounds, took = [], []
    for lay in todo:
        t0 = time.perf_counter()
        bounds.append(bound_of(inputs, lay) if prune else 0.0)
        took.append(time.perf_counter() - t0)
    order = sorted(range(len(todo)), key=lambda i: (-sum(inputs.lengths) / bounds[i] if bounds[i] else 0.0, i))
    if workers > 1 and len(todo) > 1:
        out = _in_pool(inputs, todo, bounds, took, order, plan_one, workers, prune)
        if out is not None:
            return out
    out: list[LayoutOutcome | None] = [None] * len(todo)
    best = None
    for i in order:
        out[i] = _pruned(inputs, todo[i], bounds[i], best, took[i]) or stopped(
            inputs, plan_one(inputs, todo[i], beat_step_s(inputs, best) if prune else None), best)
        best = _better(best, out[i])
    return out


def _in_pool(inputs, todo, bounds, took, order, plan_one, workers, prune) -> list[LayoutOutcome] | None:
    """:func:`plan_pruned`'s loop in a spawned pool; None (with a warning) when the pool breaks."""
    out: list[LayoutOutcome | None] = [None] * len(todo)
    best, queue = None, list(order)
    running: dict[Future, tuple[int, LayoutOutcome | None]] = {}
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn")) \
                as pool:
            while queue or running:
                while queue and len(running) < workers:
                    i = queue.pop(0)
                    out[i] = _pruned(inputs, todo[i], bounds[i], best, took[i])
                    if out[i] is None:
                        beat = beat_step_s(inputs, best) if prune else None
                        running[pool.submit(plan_one, inputs, todo[i], beat)] = (i, best)
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    i, beaten_by = running.pop(future)
                    out[i] = stopped(inputs, future.result(), beaten_by)
                    best = _better(best, out[i])
    except BrokenProcessPool as exc:
        warnings.warn(f"the layout search's process pool failed ({exc}); a script that starts processes needs "
                      f"its code under `if __name__ == '__main__':`. Planning the layouts in this process",
                      RuntimeWarning, stacklevel=4)
        return None
    return out
