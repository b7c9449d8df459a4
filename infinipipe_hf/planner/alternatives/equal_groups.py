"""Schedules on equal GPU groups in lockstep rounds (``ulysses-zero3``, ``ring-cp``).

Every group has the same size, set by a knob; the batch's micro-batches are dealt to the groups
slowest first (:func:`~infinipipe_hf.planner.batch.rounds.lockstep_rounds`: ZeRO-3 gathers every
layer over all GPUs, so every group runs the same number of rounds).  Each schedule's knob grid
is small and searched exhaustively, per batch or once for a run (``static_grid``).
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Sequence

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import GroupRun, RoundPlan
from infinipipe_hf.planner.alternatives.round_schedule import RoundContext, RoundSchedule
from infinipipe_hf.planner.batch.rounds import lockstep_rounds
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState

Builder = Callable[[Knobs, int | None], RoundPlan]
"""Plans one batch for a knob setting and a checkpoint count (``None``: the least that fits)."""


@dataclass(frozen=True)
class GridContext(RoundContext):
    grid: tuple[Knobs, ...] = ()
    """The knob settings searched."""


class EqualGroupSchedule(RoundSchedule):
    """A schedule searching a grid of knob settings, each planned by its ``builder``."""

    @abstractmethod
    def builder(self, lengths: Sequence[int], cost: FlatCost) -> Builder:
        """The plan builder of one batch (it may cache work shared by the settings)."""

    @abstractmethod
    def static_grid(self, batches: Sequence[Sequence[int]],
                    cost: FlatCost) -> list[tuple[dict, Callable[[int, int | None], RoundPlan]]]:
        """The settings a run may fix once, each with ``build(batch index, checkpoint)``."""

    def candidates(self, ctx: GridContext, state: SearchState) -> Iterator[Candidate]:
        build = self.builder(ctx.lengths, ctx.cost)
        for knobs in ctx.grid:
            yield Candidate(knobs, partial(build, knobs, ctx.checkpoint))


def equal_group_plan(schedule: str, lengths: Sequence[int], cost: FlatCost, attention: str, size: int,
                     micro_batches: list[list[int]], checkpoint: int | None, knobs: dict) -> RoundPlan:
    """Micro-batches (lists of sequence ids) on equal groups of ``size`` GPUs in lockstep rounds.

    ``checkpoint=None`` picks the least uniform count that fits the largest micro-batch; raises
    ``ValueError`` when none does.
    """
    group = cost.group(attention, size)
    padded = [group.padded_tokens(sum(lengths[s] for s in mb)) for mb in micro_batches]
    if checkpoint is None:
        checkpoint = group.least_checkpoint(max(padded), cost.room_bytes)
        if checkpoint is None:
            raise ValueError(no_fit_message(schedule, cost, group.size, max(padded), knobs))
    times = [sum(group.times(group.micro_batch_pairs([lengths[s] for s in mb], p), p, 0)[:2])
             for mb, p in zip(micro_batches, padded)]
    rounds = [[GroupRun(size, tuple(micro_batches[i])) for i in idx]
              for idx in lockstep_rounds(times, cost.world_size // size)]
    return RoundPlan(schedule, cost.world_size, list(lengths), attention, rounds, checkpoint, dict(knobs))


def no_fit_message(schedule: str, cost: FlatCost, gpus: int, tokens: int, knobs: dict) -> str:
    room = cost.room_bytes / 2**30
    return (f"{schedule} with {knobs}: a micro-batch of {tokens} tokens on {gpus} GPU(s) does not fit "
            f"{cost.memory_budget_bytes / 2**30:.1f} GiB per GPU even with every layer checkpointed "
            f"({room:.1f} GiB left beside the ZeRO-3 states)")


def check_sizes(name: str, asked: Sequence[int] | None, allowed: Sequence[int]) -> list[int]:
    """``asked`` group sizes (all of ``allowed`` when None), each checked against ``allowed``."""
    if not asked:
        return list(allowed)
    bad = [g for g in asked if g not in allowed]
    if bad:
        raise ValueError(f"{name}={bad[0]!r} is not possible here; use one of {', '.join(map(str, allowed))} "
                         f"(powers of two dividing the world size; Ulysses also at most the model's heads)")
    return sorted(set(int(g) for g in asked))
