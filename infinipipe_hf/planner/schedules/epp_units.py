"""EPP's units of one knob setting, per DP replica, grouped into 1F1B pipelines -- with SP rounds or not.

Without rounds: the elastic units (:func:`~infinipipe_hf.planner.batch.elastic.make_elastic_units`)
are grouped into pipelines by the grouping DP on the closed-form estimate (:mod:`.estimate`).

With elastic SP rounds (:mod:`infinipipe_hf.planner.batch.sub_groups`) a stage runs the units of
a round side by side on disjoint sub-groups.  The pipeline machinery (grouping, warm-up, the
1F1B order of :mod:`.pipeline`, the estimate) then works on *items*: one stand-in unit per round
holding all its units' segments, so a chain of slices keeps its order and a round of whole
sequences has none (:class:`RoundItems`).  Every stage's action list is expanded item by item
into the round's units, in sub-group order: a round's forwards are consecutive and so are its
backwards, and every stage runs the same rounds in the same order (the runtime's contract).
EPP's warm-up counts rounds: ``(pp - 1 - r) + (N - 1)`` with ``N`` the rounds holding the
pipeline's first sequence.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Sequence

from infinipipe_hf.ir.actions import Action, like
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.planner.batch.elastic import SlicingResult, make_elastic_units
from infinipipe_hf.planner.batch.sub_groups import RoundedUnits, elastic_rounds, rounds_of_groups
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.actions import replica_actions
from infinipipe_hf.planner.pipeline.estimate import PipelineEstimator
from infinipipe_hf.planner.pipeline.grouping import (
    MAX_GROUPING_BLOCKS,
    blocks_by_slice_count,
    group_pipelines,
    merge_blocks,
)


class RoundItems:
    """The items of one replica's rounds, numbered from ``first_item`` (module docstring)."""

    def __init__(self, rounded: RoundedUnits, cost: CostModel, first_item: int = 0):
        self.rounded = rounded
        by_id = {u.id: u for u in rounded.units}
        self.items: list[Unit] = []
        self.members: dict[int, list[Unit]] = {}
        for i, ids in enumerate(rounded.rounds):
            units = [by_id[u] for u in ids]
            item = Unit(first_item + i, tuple(s for u in units for s in u.segments))
            self.items.append(item)
            self.members[item.id] = units
        groups = rounded.sp_groups
        self.costs = {item: [(u, cost.for_group(groups[u.id].size) if u.id in groups else cost) for u in units]
                      for item, units in self.members.items()}
        """Item id -> its units with the cost of each one's sub-group (the estimator's input)."""

    def actions(self, lengths: Sequence[int], cost: CostModel, pipelines: Sequence[Sequence[Unit]], dp_rank: int,
                warmup: Callable[[list[Unit]], list[int]]) -> tuple[list[Unit], list[list[Action]]]:
        """The replica's units (tagged with pipeline and replica) and per-stage actions."""
        tagged, stages = replica_actions(lengths, cost, pipelines, dp_rank, warmup)
        units = [replace(u, pipeline=item.pipeline, dp_rank=dp_rank) for item in tagged
                 for u in self.members[item.id]]
        expanded = [[like(a, u.id) for a in acts for u in self.members[a.unit]] for acts in stages]
        return units, expanded


class Staged(NamedTuple):
    """One replica's units of one knob setting, grouped into pipelines."""

    res: SlicingResult | None
    """The elastic units (None: the replica has no sequence)."""
    pipelines: list
    """Units per pipeline (with rounds: each round's item, :class:`RoundItems`)."""
    estimate: float
    items: RoundItems | None = None
    """The replica's rounds, when its short sequences run on SP sub-groups."""


def epp_units(lengths, replicas, cost, k, max_tokens_per_unit, floor, rounds: bool = False,
              whole: Sequence[Staged] | None = None) -> list[Staged]:
    """Per replica: its units grouped into pipelines (with ``rounds``: in SP rounds where some
    short sequence runs on a sub-group).  ``whole``: the same setting staged without rounds,
    whose elastic units (and, where no round forms, pipelines) are reused."""
    staged = []
    next_id = next_item = 0
    for r, seqs in enumerate(replicas):
        if not seqs:
            staged.append(Staged(None, [], 0.0))
            continue
        before = whole[r] if whole is not None and whole[r].res is not None else None
        if before is not None and before.res.units[0].id == next_id:
            res = before.res
        else:
            res, before = make_elastic_units(lengths, cost, k, seqs=seqs, max_tokens_per_unit=max_tokens_per_unit,
                                             first_unit_id=next_id, min_token_budget=floor), None
        rounded = elastic_rounds(res, lengths, cost, next_id) if rounds else None
        if rounded is None:
            next_id += len(res.units)
            staged.append(before or Staged(res, *_grouped(res.units, res, cost, lengths)))
            continue
        next_id += len(rounded.units)
        items = RoundItems(rounded, cost, next_item)
        next_item += len(items.items)
        staged.append(Staged(res, *_grouped(items.items, res, cost, lengths, items.costs), items))
    return staged


def adopted_units(lengths, cost, rounds) -> list[Staged] | None:
    """The one replica of a pp 1, dp 1 layout staged as the given rounds of ``(GPUs, whole
    sequences)`` (:func:`~infinipipe_hf.planner.batch.sub_groups.rounds_of_groups`), or None where
    they are not units of this layout."""
    rounded = rounds_of_groups(rounds, lengths, cost)  # the layout is checked by plan_step (search/adopted.py)
    if rounded is None:
        return None
    res = SlicingResult(rounded.units, 1, [], 0.0, max(lengths), {q: 1 for q in range(len(lengths))})
    items = RoundItems(rounded, cost)
    return [Staged(res, *_grouped(items.items, res, cost, lengths, items.costs), items)]


def margin_estimate(staged: Sequence[Staged], cost: CostModel, lengths, safety: float = 1.0) -> float:
    """The estimate of a knob setting's staged units (the largest over replicas) with memory
    planned up to the whole budget (``safety=1``): finite for a setting the estimate's safety
    margin alone rules out, which may still fit exactly (a round of single-GPU units near the
    budget, as FlexSP plans it).  ``safety=math.inf``: memory ignored (no recompute priced)."""
    worst = 0.0
    for st in staged:
        if st.res is None:
            continue
        units = st.items.items if st.items is not None else st.res.units
        estimator = PipelineEstimator(units, cost, lengths, st.items.costs if st.items is not None else None,
                                      safety=safety)
        worst = max(worst, sum(estimator.time_of_ids([u.id for u in p]) for p in st.pipelines))
    return worst


def _grouped(units: list[Unit], res: SlicingResult, cost: CostModel, lengths, members=None) -> tuple[list, float]:
    """``units`` (or round items) in pipelines by the grouping DP, and their estimated time."""
    per_id = {u.id: u for u in units}
    blocks = blocks_by_slice_count(units, res.slice_counts)
    if len(blocks) > MAX_GROUPING_BLOCKS:
        blocks = merge_blocks(blocks, MAX_GROUPING_BLOCKS)
    estimator = PipelineEstimator(units, cost, lengths, members)
    groups = group_pipelines(blocks, estimator.time_of_ids)
    pipelines = [[per_id[i] for i in ids] for ids in groups]
    return pipelines, sum(estimator.time_of_ids(ids) for ids in groups)
