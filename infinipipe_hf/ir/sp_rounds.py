"""Elastic sequence parallelism inside a stage: sub-groups of the stage's SP ranks, and rounds.

A unit may run on a *sub-group* of its stage's ``sp_degree`` ranks: ``size`` ranks (a power of
two dividing ``sp_degree``) starting at SP rank ``offset`` (a multiple of ``size``, so groups are
aligned as FlexSP's are).  A *round* is a set of units whose sub-groups partition the stage's SP
ranks: they run at the same time, each with Ulysses over its own sub-group (a sub-group of one
runs its unit with no all-to-all).  Every stage runs the same rounds on the same sub-groups, so SP
rank ``i`` of stage ``s`` sends to SP rank ``i`` of stage ``s + 1``.  A plan without sub-groups
runs every unit on the whole SP group, each unit its own round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


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

    def check(self, sp_degree: int, what: str = "sub-group") -> None:
        """``ValueError`` unless a power-of-two size dividing ``sp_degree`` at an aligned offset."""
        ok_size = self.size >= 1 and self.size & (self.size - 1) == 0 and sp_degree % self.size == 0
        if not ok_size or self.offset % self.size or not 0 <= self.offset < sp_degree:
            sizes = [g for g in (1 << k for k in range(sp_degree.bit_length())) if sp_degree % g == 0]
            raise ValueError(f"{what} (offset {self.offset}, size {self.size}) is not an aligned SP sub-group of "
                             f"sp_degree={sp_degree}: the size must be one of {sizes} and the offset a "
                             f"multiple of it below {sp_degree}")


def whole_group(sp_degree: int) -> SubGroup:
    return SubGroup(0, sp_degree)


def check_rounds(rounds: Sequence[Sequence[int]], groups: Mapping[int, SubGroup], sp_degree: int,
                 unit_ids: Iterable[int]) -> None:
    """Every unit in exactly one round; each round's sub-groups partition the SP ranks."""
    ids = set(unit_ids)
    seen: dict[int, int] = {}
    for r, members in enumerate(rounds):
        covered: list[int] = []
        for u in members:
            if u not in ids:
                raise ValueError(f"round {r} names unit {u}, which the plan does not have")
            if u in seen:
                raise ValueError(f"unit {u} is in round {seen[u]} and round {r}; a unit runs in one round")
            seen[u] = r
            g = groups.get(u, whole_group(sp_degree))
            g.check(sp_degree, f"unit {u}'s sub-group")
            covered.extend(g.ranks)
        if sorted(covered) != list(range(sp_degree)):
            raise ValueError(f"round {r} (units {list(members)}) covers SP ranks {sorted(covered)}; the "
                             f"sub-groups of a round must cover ranks 0..{sp_degree - 1} exactly once")
    missing = sorted(ids - set(seen))
    if rounds and missing:
        raise ValueError(f"units {missing[:8]} are in no round; with rounds every unit is in one")
