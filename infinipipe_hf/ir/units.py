"""Segments and units: the elastic micro-units that flow through the pipeline.

A *segment* is a contiguous token range ``[start, end)`` of one sequence; ``start > 0`` means
it carries a context of ``start`` earlier tokens whose K/V it attends to (they were produced by
earlier slices of the same sequence).  A *unit* is a list of segments processed in one forward.
Units are immutable plain data so plans can be hashed, compared and serialised.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence


@dataclass(frozen=True, order=True)
class Segment:
    """Tokens ``[start, end)`` of sequence ``seq``; ``start`` tokens of context precede it."""

    seq: int
    start: int
    end: int

    def __post_init__(self) -> None:
        assert 0 <= self.start < self.end, f"empty or negative segment {self}"

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def context(self) -> int:
        return self.start

    def to_list(self) -> list[int]:
        return [self.seq, self.start, self.end]


class UnitKind(str, Enum):
    PACKED = "packed"  # whole short sequences only
    SLICE = "slice"  # one segment that is not a whole sequence
    HYBRID = "hybrid"  # the tail slice of a long sequence plus whole short sequences


@dataclass(frozen=True)
class Unit:
    """One micro-unit: ``segments`` run through a stage in a single forward."""

    id: int
    segments: tuple[Segment, ...]
    pipeline: int = 0
    dp_rank: int = 0
    # Derived once: the planner's hot loops read these hundreds of thousands of times per batch.
    num_tokens: int = field(init=False, repr=False, compare=False)
    seqs: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert self.segments, f"unit {self.id} has no segments"
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "num_tokens", sum(s.end - s.start for s in self.segments))
        object.__setattr__(self, "seqs", tuple(s.seq for s in self.segments))

    def kind(self, lengths: Sequence[int]) -> UnitKind:
        """Classify against the batch's sequence lengths."""
        partial = [s for s in self.segments if not (s.start == 0 and s.end == lengths[s.seq])]
        if not partial:
            return UnitKind.PACKED
        if len(self.segments) == 1:
            return UnitKind.SLICE
        return UnitKind.HYBRID

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "pipeline": self.pipeline,
            "dp_rank": self.dp_rank,
            "segments": [s.to_list() for s in self.segments],
        }

    @staticmethod
    def from_dict(d: dict) -> "Unit":
        return Unit(
            id=int(d["id"]),
            segments=tuple(Segment(int(a), int(b), int(c)) for a, b, c in d["segments"]),
            pipeline=int(d.get("pipeline", 0)),
            dp_rank=int(d.get("dp_rank", 0)),
        )
