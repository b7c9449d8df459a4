"""Elastic sequence parallelism inside a stage: sub-groups of the stage's SP ranks, and rounds.

A unit may run on a *sub-group* of its stage's ``sp_degree`` ranks: ``size`` ranks (a power of
two dividing ``sp_degree``) starting at SP rank ``offset`` (a multiple of ``size``, so groups are
aligned as FlexSP's are).  A *round* is a set of units whose sub-groups partition the stage's SP
ranks: they run at the same time, each with Ulysses over its own sub-group (a sub-group of one
runs its unit with no all-to-all).  Every stage runs the same rounds on the same sub-groups, so SP
rank ``i`` of stage ``s`` sends to SP rank ``i`` of stage ``s + 1``.  A plan without sub-groups
runs every unit on the whole SP group, each unit its own round.  The checks need the stage's SP
rank count, so they are the plan's (``Plan.check_rounds``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SubGroup:
    """SP ranks ``offset .. offset + size - 1`` of a stage."""

    offset: int
    size: int

    def contains(self, sp_rank: int) -> bool:
        return self.offset <= sp_rank < self.offset + self.size

    @property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.size)
