"""Per-action timeline of a step: when each rank started and ended each action, and how long it
waited for a peer.

Design: plain data (dataclasses of floats/ints/strings) so a timeline is JSON-serialisable, can be
gathered with ``all_gather_object`` and merged into one rank-by-time grid for plots and for
comparing against the simulator.  Times are wall-clock seconds (``time.time``) so timelines of
different processes on one host line up; ``relative()`` shifts them to start at zero.  Trade-off:
wall clocks of different hosts are not synchronised, so cross-node grids may be skewed by the
clock offset (good enough for bubbles, not for microsecond analysis).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class TimelineEvent:
    rank: int
    stage: int
    dp_rank: int
    action: str
    start_s: float
    end_s: float
    wait_s: float = 0.0
    """Time inside [start_s, end_s] spent blocked on a receive from a peer."""
    cpu_s: float = 0.0
    """CPU seconds the rank's thread used inside [start_s, end_s] (``time.thread_time``): the
    action's work.  Wall time beyond ``cpu_s + wait_s`` is time the scheduler gave the core to
    another process (ranks sharing cores, or other jobs)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    step: int = 0
    events: list[TimelineEvent] = field(default_factory=list)

    def add(self, event: TimelineEvent) -> None:
        self.events.append(event)

    @property
    def start_s(self) -> float:
        return min((e.start_s for e in self.events), default=0.0)

    @property
    def end_s(self) -> float:
        return max((e.end_s for e in self.events), default=0.0)

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    def busy_s(self, rank: int) -> float:
        """Time ``rank`` spent computing (action durations minus waits)."""
        return sum(e.duration_s - e.wait_s for e in self.events if e.rank == rank)

    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def bubble_fraction(self) -> float:
        """Idle share of the rank-by-time rectangle (0 for a perfect pipeline)."""
        ranks = self.ranks()
        if not ranks or self.span_s <= 0:
            return 0.0
        busy = sum(self.busy_s(r) for r in ranks)
        return max(0.0, 1.0 - busy / (len(ranks) * self.span_s))

    def relative(self) -> "Timeline":
        t0 = self.start_s
        return Timeline(self.step, [TimelineEvent(e.rank, e.stage, e.dp_rank, e.action,
                                                  e.start_s - t0, e.end_s - t0, e.wait_s, e.cpu_s)
                                    for e in self.events])

    @staticmethod
    def merge(timelines: list["Timeline"]) -> "Timeline":
        steps = {t.step for t in timelines}
        assert len(steps) <= 1, f"merging timelines of different steps {sorted(steps)}"
        events = [e for t in timelines for e in t.events]
        events.sort(key=lambda e: (e.start_s, e.rank))
        return Timeline(steps.pop() if steps else 0, events)

    def to_dict(self) -> dict:
        return {"step": self.step, "events": [asdict(e) for e in self.events]}

    @staticmethod
    def from_dict(d: dict) -> "Timeline":
        return Timeline(int(d.get("step", 0)), [TimelineEvent(**e) for e in d.get("events", [])])

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        rel = self.relative()
        lines = [f"Timeline step {self.step}: span {self.span_s * 1e3:.2f} ms, "
                 f"bubble {self.bubble_fraction():.1%}"]
        for r in rel.ranks():
            acts = " ".join(f"{e.action}@{e.start_s * 1e3:.1f}" for e in rel.events if e.rank == r)
            lines.append(f"  rank {r}: {acts}")
        return "\n".join(lines)
