"""The layout search: plan a batch with EPP on every ``pp x sp x dp x shard`` a job can run, and
the non-pipeline alternatives at their best, and recommend the fastest EPP layout that fits.

Which layouts can run: ``pp x sp`` divides the world and ``pp`` is at most the model's layer
count; ``sp`` is a power of two dividing the world that either divides ``gpus_per_node`` (one SP
group inside a node: its all-to-alls stay on the intra-node links) or is a whole number of nodes
(a group spanning nodes, its all-to-alls priced at the inter-node bandwidth, as ALST runs Ulysses
over 32 GPUs), and passes the runtime's head check; ``dp`` is what is
left; every shard mode the layout's checks accept for those degrees (:mod:`infinipipe_hf.layout`).

Each layout is planned with :func:`~infinipipe_hf.planner.search.api.plan_step`, exactly as
``python -m infinipipe_hf.plan --pp --sp --dp --shard --schedule epp`` plans it, so the
recommended layout replans to the same tokens/s.  Before planning, a layout is ruled out when
the batch has fewer sequences than its DP replicas (one would idle), when its model states alone
exceed the budget, or when the batch's longest sequence does not fit even alone with every layer
checkpointed at any slice count EPP would try (:func:`fits_alone`).  Shard
modes that shard and replicate over the same mesh dims (``sp`` and ``hybrid``: they differ only
in who reduces over DP) are priced identically and planned once.  Layouts are planned best proven
bound first, and one whose bound (its compute alone, or its candidates replayed without
recompute) is slower than a layout already planned is pruned, not planned in full (:mod:`.prune`),
so the pick equals a brute force over every layout.

Host memory (``host_budget_bytes`` per GPU, 0: none): every layout may keep layer inputs and K/V
in host memory, and is also planned with its model states there, per state-offload mode
(:mod:`.host_tier`: a heavier mode only where the lighter one leaves the states large).  With a
batch of one sequence each layout reports its largest trainable length with and without the
host tier (:mod:`.longest`).

Tie-break (stated in the output): the highest tokens/s; on equal tokens/s (relative 1e-9) the
lower peak memory per GPU, then fewer stages, then the smaller SP degree, then the shard mode's
place in ``SHARD_MODES``, then the lighter state offload.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import SHARD_MODES, SHARD_TABLE, ParallelDims, ShardMode, divisors
from infinipipe_hf.layout.state_offload import STATE_OFFLOADS
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.batch.select import check_batch
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.layout_search.adopt import adopt_ahead
from infinipipe_hf.planner.layout_search.host_tier import (
    alternative_knobs,
    offload_modes,
    planned_alternatives,
    with_offload_modes,
)
from infinipipe_hf.planner.layout_search.longest import (
    add_largest_lengths,
    fill_without_offload,
    fits_alone,
    no_fit_error,
)
from infinipipe_hf.planner.layout_search.prune import PrunedOutcome, plan_pruned
from infinipipe_hf.planner.layout_search.result import (
    LayoutOutcome,
    LayoutSearch,
    gib,
    recipe_settings,
    unfed_replicas_reason,
)
from infinipipe_hf.planner.pipeline.grids import DEFAULT_SLICE_COUNTS
from infinipipe_hf.planner.registry import REFERENCE
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step, resolve_sp_rounds
from infinipipe_hf.planner.search.grad_reduce import leanest_reduce, plans_otherwise
from infinipipe_hf.planner.search.limits import states_per_gpu
from infinipipe_hf.planner.search.result import PlanResult

TIE_BREAK = ("highest tokens/s; on equal tokens/s (relative 1e-9) the lower peak memory per GPU, then fewer "
             "stages (pp), then the smaller sp, then the shard mode's order " + " < ".join(SHARD_MODES)
             + ", then the state offload's " + " < ".join(STATE_OFFLOADS))


def _passes(check, *args) -> bool:
    try:
        check(*args)
    except ValueError:
        return False
    return True


def sp_candidates(spec: ModelSpec, world_size: int, gpus_per_node: int) -> list[int]:
    """SP degrees a layout may use: powers of two dividing the world that divide ``gpus_per_node``
    or are whole nodes (module docstring), that the layout's model check accepts (at least one
    attention head per SP rank)."""
    out, sp = [], 1
    while sp <= world_size:
        in_nodes = gpus_per_node % sp == 0 or sp % gpus_per_node == 0
        if in_nodes and world_size % sp == 0 and _passes(
                ParallelDims(1, sp, world_size // sp).check_model, spec.num_layers, spec.num_attention_heads):
            out.append(sp)
        sp *= 2
    return out


def _runnable(layout: ParallelDims, mode: ShardMode) -> ParallelDims | None:
    """``layout`` sharded by ``mode``, when the planner can price it and the runtime can run it."""
    try:
        dims = replace(layout, shard=mode)
        dims.check_runnable()
    except ValueError:
        return None
    return dims


def shard_candidates(layout: ParallelDims) -> list[ParallelDims]:
    """The layouts of ``layout``'s degrees and nodes, one per shard mode the layout's checks accept."""
    found = (_runnable(layout, mode) for mode in SHARD_TABLE.values())
    return [dims for dims in found if dims is not None]


def enumerate_layouts(spec: ModelSpec, world_size: int, gpus_per_node: int, *,
                      sp_degrees: Sequence[int] | None = None, shards: Sequence[str] | None = None,
                      dp_degrees: Sequence[int] | None = None) -> list[ParallelDims]:
    """Every layout that can run on ``world_size`` GPUs (module docstring), ``sp`` then ``pp``
    ascending; ``sp_degrees`` / ``shards`` / ``dp_degrees`` restrict the search.  ``ValueError``
    when none can."""
    for name, value in (("world_size", world_size), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size > gpus_per_node and world_size % gpus_per_node:
        raise ValueError(f"world size {world_size} is not a whole number of nodes of {gpus_per_node} GPUs; "
                         f"set gpus_per_node (--gpus-per-node) to the GPUs each node runs, a divisor of {world_size}")
    unknown = [s for s in shards or () if s not in SHARD_MODES]  # the search matches names, never looks one up
    if unknown:
        raise ValueError(f"shard={unknown[0]!r} is not known; use one of {', '.join(SHARD_MODES)}")
    sps = sp_candidates(spec, world_size, gpus_per_node)
    allowed = [sp for sp in sps if sp_degrees is None or sp in sp_degrees]
    out = []
    for sp in allowed:
        for pp in divisors(world_size // sp):
            if pp > spec.num_layers:
                continue
            dp = world_size // (pp * sp)
            if dp_degrees is not None and dp not in dp_degrees:
                continue
            layouts = shard_candidates(ParallelDims(pp, sp, dp, gpus_per_node=gpus_per_node))
            out.extend(d for d in layouts if shards is None or d.shard.name in shards)
    if not out:
        raise ValueError(_no_layout_message(spec, world_size, gpus_per_node, sps, sp_degrees, shards))
    return out


def _no_layout_message(spec, world_size, gpus_per_node, sps, sp_degrees, shards) -> str:
    asked = ", ".join(f"{k} in {tuple(v)}" for k, v in (("sp_degree", sp_degrees), ("shard", shards)) if v is not None)
    return (f"no parallel layout of {world_size} GPUs ({gpus_per_node} per node) can run this model"
            + (f" with {asked}" if asked else "")
            + f": a layout needs pp x sp dividing {world_size}, pp <= the model's {spec.num_layers} layers, "
              f"sp a power of two dividing {gpus_per_node} or a whole number of nodes, at most the "
              f"{spec.num_attention_heads} attention "
              f"heads (sp here: {', '.join(map(str, sps)) or 'none'}), and a shard mode with ranks to shard over; "
              f"relax the restriction or change the world size")


def plan_layouts(inputs: SearchInputs, layouts: Sequence[ParallelDims], workers: int = 1,
                 prune: bool = True) -> list[LayoutOutcome]:
    """Each layout's outcome, in order; layouts priced alike are planned once, the distinct ones
    best proven bound first in ``workers`` processes (spawned: safe under a process that runs
    threads or torch), and with ``prune`` those whose bound cannot beat a planned one are not
    planned (:mod:`.prune`: the pick is the exhaustive search's)."""
    if isinstance(workers, bool) or int(workers) != workers or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    firsts: dict[tuple, ParallelDims] = {}
    for layout in layouts:
        firsts.setdefault(pricing_key(layout), layout)
    todo = list(firsts.values())
    planned = plan_pruned(inputs, todo, plan_layout, workers, prune and not inputs.longest)
    by_key = {pricing_key(o.layout): o for o in planned}
    return [by_key[pricing_key(lay)] if by_key[pricing_key(lay)].layout == lay
            else plan_layout(inputs, lay) if plans_otherwise(inputs.plan_options.get("grad_reduce", "auto"),
                                                             by_key[pricing_key(lay)], lay)
            else by_key[pricing_key(lay)].priced_as_layout(lay) for lay in layouts]


def pricing_key(layout: ParallelDims) -> tuple:
    """Layouts with equal keys get the same plan: the cost model reads the shard mode's dims only."""
    return (layout.pp_degree, layout.sp_degree, layout.dp_degree, layout.shard.pricing_key, layout.state_offload.name)


@dataclass(frozen=True)
class SearchInputs:
    """What every layout of one search is planned with."""

    lengths: list[int]
    spec: ModelSpec
    profile: HardwareProfile
    memory_budget_bytes: float
    gpus_per_node: int
    plan_options: Mapping[str, Any]
    """Keyword arguments passed to every ``plan_step`` (checkpointing, levels, unit cap...)."""
    host_budget_bytes: float = 0.0
    """Host memory per GPU a plan may use (0: no host tier)."""
    longest: bool = False
    """Also find each layout's largest one-sequence length with and without the host tier."""

    def cost(self, layout: ParallelDims, host_budget_bytes: float | None = None) -> CostModel:
        host = self.host_budget_bytes if host_budget_bytes is None else host_budget_bytes
        return CostModel(self.spec, self.profile, layout, memory_budget_bytes=self.memory_budget_bytes,
                         host_budget_bytes=host)

    def options(self, layout: ParallelDims, **override) -> PlanOptions:
        """EPP's plan options for ``layout``: ``sp_rounds=True`` asks for rounds where a stage has SP
        ranks to split, so a layout with one rank per stage plans without them."""
        options = {**self.plan_options, **override}
        if options.get("sp_rounds") and layout.sp_degree == 1:
            options["sp_rounds"] = None
        sp = layout.sp_degree  # the alternatives' plans are rounds of pp 1 x sp = world (a power of two) only
        if options.get("adopt_rounds_of") and ((layout.pp_degree, layout.dp_degree) != (1, 1) or sp < 2 or sp & (sp - 1)):
            options.pop("adopt_rounds_of")
        return PlanOptions(schedule=REFERENCE, **options)


def plan_layout(inputs: SearchInputs, layout: ParallelDims, beat_step_s: float | None = None) -> LayoutOutcome:
    """One layout's outcome: ruled out before planning (states, longest sequence) or planned (its
    planning stopped when it proves no plan runs under ``beat_step_s``, ``plan_step``); with
    ``inputs.longest`` also its largest one-sequence lengths."""
    t0 = time.perf_counter()
    if len(inputs.lengths) < layout.dp_degree:
        return LayoutOutcome(layout, None, unfed_replicas_reason(len(inputs.lengths), layout), 0.0,
                             unfed_replicas=True)
    outcome = _plan_fed_layout(inputs, layout, t0, beat_step_s)
    if inputs.longest:
        add_largest_lengths(inputs, outcome, pricing_key)
        outcome.search_time_s = time.perf_counter() - t0
    return outcome


def _plan_fed_layout(inputs: SearchInputs, layout: ParallelDims, t0: float, beat_step_s: float | None) -> LayoutOutcome:
    cost = inputs.cost(layout)
    options = inputs.options(layout)
    lean = leanest_reduce(cost, options.grad_reduce)
    states = states_per_gpu(lean)
    budget = inputs.memory_budget_bytes
    if states > budget:
        return LayoutOutcome(layout, None, f"model states alone need {gib(states)} GiB per GPU, over the "
                                           f"{gib(budget)} GiB budget", time.perf_counter() - t0)
    longest = max(inputs.lengths)
    # The leanest plan keeps every checkpoint on the device: a bound only without a host tier.
    if not inputs.host_budget_bytes and not fits_alone(lean, longest, inputs.plan_options.get("num_slices")):
        return LayoutOutcome(layout, None, f"the longest sequence ({longest} tokens) does not fit even alone, "
                                           f"fully checkpointed, in any of 1 to {max(DEFAULT_SLICE_COUNTS)} slices",
                             time.perf_counter() - t0)
    result = plan_step(inputs.lengths, inputs.spec, layout, options, cost=cost, beat_step_s=beat_step_s)
    return LayoutOutcome(layout, result, None, time.perf_counter() - t0,
                         sp_rounds=resolve_sp_rounds(options.sp_rounds, layout.sp_degree))


def whole_group_replan(inputs: SearchInputs, best: LayoutOutcome) -> PlanResult | None:
    """The recommended layout planned without elastic SP rounds, when its plan uses them (both
    are reported: the rounds' gain on the pick)."""
    if not best.sp_rounds:
        return None
    lay = best.layout
    return plan_step(inputs.lengths, inputs.spec, lay, inputs.options(lay, sp_rounds=False), cost=inputs.cost(lay))


def plan_alternatives(inputs: SearchInputs, world_size: int) -> dict:
    """Each non-pipeline alternative on all ``world_size`` GPUs, tuned over its own knobs."""
    flat = FlatCost.of(inputs.spec, world_size, inputs.memory_budget_bytes, inputs.profile, inputs.gpus_per_node)
    checkpointing = inputs.plan_options.get("checkpointing", "adaptive")
    return {name: plan_alternative(inputs.lengths, inputs.spec, name, world_size=world_size, cost=flat,
                                   checkpointing=checkpointing, **alternative_knobs(name, inputs.host_budget_bytes))
            for name in planned_alternatives(inputs.host_budget_bytes)}


def pruned_summary(outcomes: Sequence[LayoutOutcome]) -> dict:
    """The search JSON's additive ``pruned_layouts`` (one entry per pruned layout) and ``num_pruned``."""
    pruned = [o for o in outcomes if isinstance(o, PrunedOutcome)]
    return {"num_pruned": len(pruned),
            "pruned_layouts": [{**o.layout.degrees(), **o.pruned_dict()} for o in pruned]}


def rank_key(outcome: LayoutOutcome) -> tuple:
    """Sort key of the tie-break (``TIE_BREAK``): feasible first, fastest first; then those not planned
    in full (they may fit), highest bound first; then those that do not fit."""
    lay = outcome.layout
    order = (lay.pp_degree, lay.sp_degree, SHARD_MODES.index(lay.shard.name), STATE_OFFLOADS.index(lay.state_offload.name))
    if not outcome.feasible:
        return (1, -outcome.bound_tokens_per_s, 0.0, *order) if isinstance(outcome, PrunedOutcome) else (2, 0, 0, *order)
    return (0, -outcome.tokens_per_s, outcome.peak_memory_bytes, *order)


def pick(outcomes: Sequence[LayoutOutcome]) -> LayoutOutcome | None:
    """The recommended layout: the fastest feasible one, ties broken as ``TIE_BREAK`` says."""
    feasible = [o for o in outcomes if o.feasible]
    if not feasible:
        return None
    top = max(o.tokens_per_s for o in feasible)
    near = [o for o in feasible if o.tokens_per_s >= top * (1 - 1e-9)]
    return min(near, key=lambda o: (o.peak_memory_bytes, *rank_key(o)[3:]))


def search_layouts(lengths: Sequence[int], spec: ModelSpec, *, world_size: int, gpus_per_node: int | None = None,
                   memory_budget_bytes: float | None = None, profile: HardwareProfile | None = None,
                   sp_degrees: Sequence[int] | None = None, shards: Sequence[str] | None = None,
                   alternatives: bool = True, plan_options: Mapping[str, Any] | None = None,
                   workers: int = 1, dp_degrees: Sequence[int] | None = None, host_budget_bytes: float = 0.0,
                   state_offloads: Sequence[str] | None = None, longest: bool | None = None,
                   prune: bool = True) -> LayoutSearch:
    """Plan ``lengths`` (one global batch) with EPP on every layout of ``world_size`` GPUs and
    recommend the fastest that fits (module docstring).

    ``gpus_per_node`` and ``memory_budget_bytes`` default to the profile's; ``sp_degrees`` /
    ``shards`` (and ``dp_degrees``) restrict the layouts; ``alternatives`` also plans ulysses-zero3, ring-cp and flexsp
    on the same GPUs; ``plan_options`` go to every ``plan_step``; ``workers`` > 1 plans the layouts
    in that many processes (the same pick; with ``prune`` which layouts are pruned may depend on
    which finish first, without it every result is the same).  ``host_budget_bytes``:
    host memory per GPU (0: no host tier); ``state_offloads`` restricts the state-offload modes;
    ``longest`` finds each layout's largest one-sequence length (default: for a one-sequence
    batch).  ``prune``: skip layouts a proven bound shows cannot be the pick (:mod:`.prune`; the
    same pick as ``prune=False``, which plans every layout).  ``ValueError`` when no layout can
    run; :class:`NoLayoutFits` (with the search attached) when none fits the budget.
    """
    t0 = time.perf_counter()
    check_batch(lengths)
    profile = profile or default_profile()
    gpn = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    budget = profile.memory_gib * GIB if memory_budget_bytes is None else float(memory_budget_bytes)
    modes = offload_modes(host_budget_bytes, state_offloads)
    layouts = enumerate_layouts(spec, world_size, gpn, sp_degrees=sp_degrees, shards=shards, dp_degrees=dp_degrees)
    inputs = SearchInputs([int(n) for n in lengths], spec, profile, budget, gpn, dict(plan_options or {}),
                          float(host_budget_bytes), len(lengths) == 1 if longest is None else bool(longest))
    fed = [lay for lay in layouts if lay.dp_degree <= len(lengths)]  # unfed ones are ruled out once
    layouts = with_offload_modes(fed, modes, lambda lay: states_per_gpu(inputs.cost(lay)), budget) + [
        lay for lay in layouts if lay.dp_degree > len(lengths)]
    outcomes = plan_layouts(inputs, layouts, workers, prune)
    if inputs.longest:
        fill_without_offload(inputs, outcomes, pricing_key)
    alts = plan_alternatives(inputs, world_size) if alternatives else {}
    best, adopted = adopt_ahead(inputs, outcomes, alts, world_size, pick(outcomes), plan_layout, pick)
    settings = recipe_settings(inputs.lengths, budget, inputs.plan_options)
    if adopted:
        settings["adopt_rounds_of"] = list(adopted)
    if host_budget_bytes:
        settings["host_memory_gib"] = host_budget_bytes / GIB
    search = LayoutSearch(world_size, gpn, budget, sorted(outcomes, key=rank_key), alts, best, TIE_BREAK,
                          time.perf_counter() - t0, settings=settings, host_budget_bytes=float(host_budget_bytes),
                          extra=pruned_summary(outcomes))
    if best is not None:
        search.without_sp_rounds = whole_group_replan(inputs, best)
        search.search_time_s = time.perf_counter() - t0
    if best is None:
        raise no_fit_error(inputs, search, t0, pricing_key)
    return search
