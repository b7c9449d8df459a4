"""The longest single sequence a layout trains: the leanest-plan bound and the planned answer.

Two questions, two prices:

- :func:`fits_alone` / :func:`largest_alone` ask the simulator about the leanest plan of one
  sequence (every layer checkpointed, as many slices as EPP tries): milliseconds a length, a
  bound used to rule layouts out before planning and to seed the search below;
- :func:`searched` asks what ``plan_step`` would, the answer a user gets when the batch is one
  sequence (``--search-layout`` with one length; the trainer's preflight), with the host tier's
  offload levels that the leanest plan does not use: :func:`largest_length` searches on the
  feasibility of ``plan_step``'s candidate search (:func:`candidates_fit`: ``plan_step`` without
  the message of a failure, which would search a largest length itself), a power-of-two search
  from the seed, then bisection until the bracket is within ``1 / RESOLUTION`` of its lower end;
  ``plan_step`` itself then confirms the length found (:func:`confirmed`).  Like ``plan_step``,
  the feasibility tries each gradient-reduce mode it would plan (a sharded stage reducing per unit
  holds less).  Feasibility is nearly
  monotone in the length (a longer sequence needs every byte a shorter one does, but the slice
  grid EPP searches changes with the length, so a length inside the bracket may fail where a
  longer one fits): the answer is a length ``plan_step`` trains, within about ``1 / RESOLUTION``
  of the limit, and never below a one-sequence batch the layout planned.  :class:`LengthCache` keeps each answer per (pricing, host budget, length).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

from infinipipe_hf.ir.grad_reduce import unit_reduce_problem
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.layout.state_offload import NO_OFFLOAD
from infinipipe_hf.planner.batch.dp_assign import assign_sequences
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.layout_search.result import NoLayoutFits
from infinipipe_hf.planner.pipeline.grids import DEFAULT_SLICE_COUNTS, slice_count_candidates
from infinipipe_hf.planner.registry import REFERENCE, SCHEDULES, get_schedule
from infinipipe_hf.planner.schedules.base import PIPELINE
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext
from infinipipe_hf.planner.search.api import PlanOptions, plan_step, resolve_sp_rounds
from infinipipe_hf.planner.search.finish import host_states_message
from infinipipe_hf.planner.search.grad_reduce import leanest_reduce, reduce_modes, with_reduce
from infinipipe_hf.planner.search.limits import (
    SEARCH_CAP,
    largest_trainable_length,
    states_per_gpu,
    states_remedies,
)
from infinipipe_hf.planner.search.loop import run_search
from infinipipe_hf.planner.search.whole_units import try_whole_sequences
from infinipipe_hf.planner.simulate.simulator import simulate

RESOLUTION = 16
"""The planned largest length is within ``1/RESOLUTION`` of the true limit (below it)."""
SMALLEST = 256
"""Lengths below this are not searched (0 is reported instead)."""


def fits_alone(cost: CostModel, tokens: int, num_slices: Sequence[int] | None = None) -> bool:
    """True when one sequence of ``tokens`` fits EPP's plan of it alone, every layer checkpointed,
    at one of the slice counts EPP would try.  Every count is tried: more slices are not always
    leaner (at pp 1 all slices of a sequence run forward before any backward, so their K/V store
    and saved layer inputs add up, while one slice fits)."""
    leanest = get_schedule(REFERENCE, PIPELINE).leanest_plan
    ks = slice_count_candidates([tokens], num_slices, cost.dims)
    for k in (ks[-1], *ks[:-1]):  # the most slices first: the leanest wherever pp > 1
        try:
            if simulate(leanest(cost, tokens, k), cost).feasible:
                return True
        except ValueError:
            continue
    return False


def largest_alone(cost: CostModel) -> int:
    """The longest single sequence ``cost``'s layout trains in the leanest plan: the largest over
    slice counts of :func:`~infinipipe_hf.planner.search.limits.largest_trainable_length`."""
    return max(largest_trainable_length(cost, k) for k in (1, max(DEFAULT_SLICE_COUNTS)))


def largest_length(fits: Callable[[int], bool], seed: int = 4096, cap: int = SEARCH_CAP,
                   resolution: int = RESOLUTION) -> int:
    """The largest ``n`` with ``fits(n)``, within ``1 / resolution`` below the limit (0 when not
    even ``SMALLEST`` tokens fit): doubling or halving from the power of two at or below ``seed``,
    then bisection of the last octave.  ``fits`` must be monotone (true up to a limit)."""
    n = 1 << (max(int(seed), SMALLEST).bit_length() - 1)
    if fits(n):
        lo, hi = n, None
        while lo * 2 <= cap:
            if not fits(lo * 2):
                hi = lo * 2
                break
            lo *= 2
        if hi is None:
            return lo
    else:
        hi, lo = n, n // 2
        while lo >= SMALLEST and not fits(lo):
            hi, lo = lo, lo // 2
        if lo < SMALLEST:
            return 0
    while hi - lo > max(1, lo // resolution):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class LengthCache:
    """``plan_step`` feasibility of one sequence, cached per (pricing key, host budget, length)."""

    def __init__(self, plan_one: Callable[[object, float, int], bool], key: Callable[[object], tuple]):
        self._plan_one = plan_one
        self._key = key
        self._seen: dict[tuple, bool] = {}
        self.plans = 0
        """``plan_step`` calls made (the rest were cached)."""

    def fits(self, layout, host_budget_bytes: float, n: int) -> bool:
        k = (self._key(layout), float(host_budget_bytes), int(n))
        if k not in self._seen:
            self.plans += 1
            self._seen[k] = self._plan_one(layout, host_budget_bytes, int(n))
        return self._seen[k]

    def largest(self, layout, host_budget_bytes: float, seed: int) -> int:
        """The largest length ``layout`` trains with this host budget (:func:`largest_length`)."""
        return largest_length(lambda n: self.fits(layout, host_budget_bytes, n), seed)


def searched(inputs, layout: ParallelDims, host_budget_bytes: float, seed: int, key) -> int:
    """The largest one-sequence length of ``layout``: searched on the candidates' feasibility, then
    confirmed by ``plan_step`` (:func:`confirmed`)."""
    n = LengthCache(functools.partial(plan_one, inputs), key).largest(layout, host_budget_bytes, seed)
    return confirmed(inputs, layout, host_budget_bytes, n) if n else 0


def candidates_fit(lengths: list[int], cost: CostModel, options: PlanOptions) -> bool:
    """Whether ``plan_step``'s candidate search finds a plan of ``lengths`` that fits under one of
    the gradient-reduce modes it plans (the leaner ``unit`` first): its feasibility, without the
    message an infeasible ``plan_step`` builds (which searches the largest length itself, most of
    the time of a failing plan)."""
    modes = reduce_modes(options.grad_reduce, cost)
    return any(_candidates_fit(lengths, with_reduce(cost, mode), options) for mode in reversed(modes))


def _candidates_fit(lengths: list[int], cost: CostModel, options: PlanOptions) -> bool:
    if states_per_gpu(cost) >= cost.memory_budget_bytes or host_states_message(cost, options.schedule):
        return False
    sched = SCHEDULES[options.schedule]
    ctx = PipelineContext(lengths, assign_sequences(lengths, cost.dims.dp_degree, cost), cost,
                          sched.checkpoint_policy(options.checkpointing), options.max_tokens_per_unit,
                          options.num_slices, options.solver_time_limit_s,
                          resolve_sp_rounds(options.sp_rounds, cost.dims.sp_degree, options.schedule))
    state = run_search(sched, ctx)
    if options.schedule == "epp" and state.best is None:  # plan_step's whole-sequence candidate
        try_whole_sequences(ctx, state, sched.name)
    return state.best is not None


def plan_one(inputs, layout: ParallelDims, host_budget_bytes: float, n: int) -> bool:
    """Whether one sequence of ``n`` tokens fits on ``layout`` (``inputs``: the search's
    :class:`~.search.SearchInputs`) with this host budget (:func:`candidates_fit`)."""
    return candidates_fit([n], inputs.cost(layout, host_budget_bytes), inputs.options(layout))


def confirmed(inputs, layout: ParallelDims, host_budget_bytes: float, n: int) -> int:
    """``n`` when ``plan_step`` itself fits one sequence of ``n`` tokens, else the largest length
    below it on a ``1 / RESOLUTION`` grid that it fits (0: none)."""
    step = max(1, n // RESOLUTION)
    cost, options = inputs.cost(layout, host_budget_bytes), inputs.options(layout)
    while n >= SMALLEST and not plan_step([n], inputs.spec, layout, options, cost=cost).feasible:
        n -= step
    return max(n, 0) if n >= SMALLEST else 0


def _without_host(layout: ParallelDims) -> ParallelDims:
    return dataclasses.replace(layout, state_offload=NO_OFFLOAD)


def leanest_cost(inputs, layout: ParallelDims, host_budget_bytes: float | None = None) -> CostModel:
    """The search's cost model of ``layout`` with the gradient reduction of the least model states
    ``plan_step`` would plan there (per unit where ``grad_reduce="auto"`` can run it): what bounds
    and largest lengths are judged on."""
    return leanest_reduce(inputs.cost(layout, host_budget_bytes), inputs.options(layout).grad_reduce)


def add_largest_lengths(inputs, outcome, key: Callable[[ParallelDims], tuple]) -> None:
    """Set ``outcome``'s largest one-sequence lengths: with the search's host tier (its layout's
    state offload, the host budget), and without (no state offload, no host memory) when its
    layout offloads no states (:func:`fill_without_offload` copies it to the others)."""
    lay = outcome.layout
    host = inputs.host_budget_bytes
    # A one-sequence batch the layout planned is a length it trains, whatever the search finds
    # (feasibility is not quite monotone in the length).
    planned = inputs.lengths[0] if outcome.feasible and len(inputs.lengths) == 1 else 0
    without = None
    if not lay.state_offload.offloaded:
        base = leanest_cost(inputs, lay, 0.0)
        fits = states_per_gpu(base) < inputs.memory_budget_bytes
        without = searched(inputs, lay, 0.0, largest_alone(base), key) if fits else 0
        without = max(without, planned if host == 0 else 0)
    with_host = without
    if host > 0:
        seed = max(without or 0, max(inputs.lengths) if outcome.feasible else 0, SMALLEST)
        fits = states_per_gpu(leanest_cost(inputs, lay)) < inputs.memory_budget_bytes
        with_host = max(searched(inputs, lay, host, seed, key) if fits else 0, planned)
    outcome.largest_length, outcome.largest_length_without_offload = with_host, without


def fill_without_offload(inputs, outcomes, key: Callable[[ParallelDims], tuple]) -> None:
    """The largest length without the host tier of layouts that offload states: their sibling's
    without state offload (searched here when the search did not plan it)."""
    known = {_lean_key(key, o.layout): o.largest_length_without_offload for o in outcomes
             if not o.layout.state_offload.offloaded and o.largest_length_without_offload is not None}
    for o in outcomes:
        if o.largest_length_without_offload is not None or o.unfed_replicas:
            continue
        base = _without_host(o.layout)
        if _lean_key(key, base) not in known:
            cost = leanest_cost(inputs, base, 0.0)
            fits = states_per_gpu(cost) < inputs.memory_budget_bytes
            known[_lean_key(key, base)] = searched(inputs, base, 0.0, largest_alone(cost), key) if fits else 0
        o.largest_length_without_offload = known[_lean_key(key, base)]


def _lean_key(key: Callable[[ParallelDims], tuple], layout: ParallelDims) -> tuple:
    """``key`` (the search's pricing key) and whether ``layout`` can reduce gradients per unit:
    layouts priced alike but for that (``sp`` and ``hybrid``) train different largest lengths."""
    return key(layout), unit_reduce_problem(layout) is None


HOST_ADVICE = ("or give the plan host memory (--host-memory-gib / host_memory_gib per GPU): it keeps optimizer "
               "states (state_offload='optimizer'), layer inputs and K/V there")


def no_fit_error(inputs, search, t0: float, key: Callable[[ParallelDims], tuple]) -> NoLayoutFits:
    """The error of a search where no layout fits: each layout's largest trainable sequence and
    model states per GPU and, when the states leave no room anywhere, what would fit them (the
    host tier among them when the search had none)."""
    limits: dict[tuple, tuple[int, float]] = {}
    for o in search.layouts:
        k = _lean_key(key, o.layout)
        if k not in limits:
            cost = leanest_cost(inputs, o.layout)
            planned = o.largest_length  # the one-sequence search's answer, when it ran
            limits[k] = (largest_alone(cost) if planned is None else planned, states_per_gpu(cost))
        o.largest_trainable, o.states_bytes = limits[k]
    remedies = ""
    if not any(o.largest_trainable for o in search.layouts):
        remedies = states_remedies(inputs.cost(ParallelDims(gpus_per_node=inputs.gpus_per_node)))  # from one GPU up
        if not inputs.host_budget_bytes:
            remedies += f"; {HOST_ADVICE}"
    search.search_time_s = time.perf_counter() - t0
    return NoLayoutFits(search, inputs.lengths, remedies)
