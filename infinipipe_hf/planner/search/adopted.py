"""Alternatives' plans as EPP candidates (``PlanOptions.adopt_rounds_of``).

FlexSP's step (rounds of SP groups of power-of-two sizes, each holding whole sequences),
ZeRO-3 + Ulysses' (rounds of equal groups) and packed ring CP's at cp 1 (ZeRO-3 data parallelism:
single-GPU groups) are EPP plans at pp 1 and dp 1 with ``sp_degree`` = their GPUs, sharded over SP,
with elastic SP rounds: each group a unit on an aligned sub-group.  Planned that way, with EPP's
own checkpointing, they are candidates of EPP's search like its own settings, so EPP's plan is
never behind theirs for want of reaching it; it may still differ in what the two cost models
price differently (EPP exposes FSDP gathers per unit, the alternatives' model per round).
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.registry import ALTERNATIVES, SCHEDULES
from infinipipe_hf.planner.search.loop import plan_rounds

ADOPTABLE_ATTENTION = {"ulysses": None, "ring": 1, "ring-packed": 1}
"""An alternative's attention -> the largest group whose plan is an EPP unit (None: any; ring
attention only on one GPU, where it is plain attention: EPP's SP is Ulysses)."""


def adoptable(plan) -> bool:
    """Whether a non-pipeline alternative's ``RoundPlan`` is an EPP plan (:data:`ADOPTABLE_ATTENTION`)."""
    largest = ADOPTABLE_ATTENTION.get(plan.attention, 0)
    return largest is None or all(g.gpus <= largest for r in plan.rounds for g in r)


def check_adopt_rounds_of(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple, ``ValueError`` unless each is a non-pipeline alternative."""
    if isinstance(names, str):
        names = (names,)
    bad = [n for n in names if n not in ALTERNATIVES]
    if bad:
        raise ValueError(f"adopt_rounds_of={list(names)!r}: {', '.join(map(repr, bad))} is not a non-pipeline "
                         f"alternative; use some of {', '.join(ALTERNATIVES)}")
    return tuple(names)


def _check_layout(names: Sequence[str], cost: CostModel, schedule: str, sp_rounds: bool) -> None:
    """``ValueError`` unless an alternative's rounds can be units of this layout and schedule."""
    dims = cost.dims
    if names and (schedule != "epp" or dims.pp_degree != 1 or dims.dp_degree != 1 or not sp_rounds):
        raise ValueError(f"adopt_rounds_of={list(names)!r} plans the alternatives' rounds as EPP units on SP "
                         f"sub-groups, which needs schedule='epp' at pp_degree=1 and dp_degree=1 with elastic SP "
                         f"rounds (sp_degree a power of two >= 2); got schedule={schedule!r} on {dims.label} "
                         f"(sp_rounds {'on' if sp_rounds else 'off'}); use pp 1 x sp = world or drop adopt_rounds_of")


def adopted_rounds(lengths: list[int], spec: ModelSpec, cost: CostModel, options, sp_rounds: bool) -> tuple:
    """``(alternative, rounds)`` for each of ``options.adopt_rounds_of`` (``PlanOptions``) that plans
    this batch on the layout's GPUs with the same budget and profile (as the layout search plans
    it), its rounds as ``(GPUs, whole sequences)`` groups; an alternative that does not fit, or
    whose groups EPP's SP cannot run (:data:`ADOPTABLE_ATTENTION`), is left out.  ``ValueError``
    where the layout cannot hold their plans."""
    names, checkpointing = options.adopt_rounds_of, options.checkpointing
    _check_layout(names, cost, options.schedule, sp_rounds)
    world = cost.dims.sp_degree
    flat = FlatCost.of(spec, world, cost.memory_budget_bytes, cost.ctx.profile, cost.dims.gpus_per_node,
                       options.loss_chunk_tokens)
    out = []
    for name in names:
        knobs = {"host_budget_bytes": cost.host_budget_bytes} if getattr(SCHEDULES[name], "uses_host_tier", False) \
            else {}
        result = plan_rounds(name, lengths, flat, checkpointing=checkpointing, **knobs)
        if result.feasible and adoptable(result.plan):
            out.append((name, tuple(tuple((g.gpus, tuple(g.seqs)) for g in r) for r in result.plan.rounds)))
    return tuple(out)
