"""The ``Schedule`` interface: what the search asks of every schedule, pipeline or not.

A schedule is a stateless object registered by name (:mod:`infinipipe_hf.planner.registry`).  For
one batch the search (:func:`infinipipe_hf.planner.search.loop.run_search`) takes its candidates --
typed knob values and a plan builder each -- and builds, rejects, simulates and records each one,
keeping the fastest plan that fits.  A schedule's candidate generator reads the live
:class:`SearchState`, so it can stop early or prune from what the search has seen.

Two kinds: ``pipeline`` schedules (:class:`~infinipipe_hf.planner.schedules.pipeline_schedule.
PipelineSchedule`: a ``Plan`` of per-stage action lists, which the runtime runs) and ``rounds``
schedules (the non-pipeline alternatives, :class:`~infinipipe_hf.planner.alternatives.
round_schedule.RoundSchedule`: a ``RoundPlan``, priced to be compared with).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Protocol

PIPELINE = "pipeline"
ROUNDS = "rounds"


class Knobs(ABC):
    """One candidate's knob values: a frozen dataclass per schedule."""

    @abstractmethod
    def record(self) -> dict:
        """The values as candidate records and messages show them (a fixed key order)."""

    @property
    def family(self) -> Any:
        """Which family of the schedule's candidates these belong to (:class:`SearchState`)."""
        return None


@dataclass(frozen=True)
class Candidate:
    """One knob setting to try."""

    knobs: Knobs
    build: Callable[[], Any]
    """Builds the plan; raises ``ValueError`` when the setting cannot hold the batch."""


FINALISTS = 2
"""Candidates a search keeps for the final checkpoint solve (:mod:`infinipipe_hf.planner.search.finish`)."""


@dataclass
class SearchState:
    """What the search has seen of one batch so far."""

    best: tuple[Any, Any] | None = None
    """``(plan, simulation)`` of the fastest candidate that fits."""
    finalists: dict[Any, list[tuple[Any, Any]]] = field(default_factory=dict)
    """Per family of candidates (EPP: on whole SP groups, with SP rounds), its ``FINALISTS``
    fastest that fit, fastest first: a final checkpoint solve can reorder them, and a search over
    a larger space must end at least as fast as the smaller one it contains."""
    tried: list[dict] = field(default_factory=list)
    """One record per candidate tried, in order."""
    last_error: str | None = None
    """Why the latest failing candidate failed."""
    last: Any = None
    """Simulation of the latest candidate; ``None`` when it failed before simulating."""

    def offer(self, plan: Any, sim: Any, family: Any = None) -> None:
        """Keep a feasible candidate among its ``family``'s finalists when it is faster than one of
        them (the first on ties), and as ``best`` when it is the fastest of all."""
        kept = self.finalists.setdefault(family, [])
        at = next((i for i, (_, s) in enumerate(kept) if sim.step_time_s < s.step_time_s), len(kept))
        kept.insert(at, (plan, sim))
        del kept[FINALISTS:]
        if self.best is None or sim.step_time_s < self.best[1].step_time_s:
            self.best = (plan, sim)


class Outcome(Protocol):
    """The fields of a search result a schedule's ``summary`` reads."""

    schedule: str
    plan: Any
    simulation: Any
    feasible: bool
    error: str | None
    planning_time_s: float
    sp_degree: int
    shard: str
    world_size: int


class Schedule(ABC):
    """A schedule: its name, kind, candidates and how its plans are simulated and reported."""

    name: ClassVar[str]
    kind: ClassVar[str]
    """``pipeline`` or ``rounds``."""
    one_tail_per_unit: ClassVar[bool] = False
    """The validator rejects a unit holding the tail slices of two sequences (EPP's units)."""
    reference: ClassVar[bool] = False
    """The schedule whose speed-up over the others the CLI reports."""

    @abstractmethod
    def candidates(self, ctx, state: SearchState) -> Iterator[Candidate]:
        """Knob settings to try for the batch in ``ctx``, best first where the schedule can tell."""

    def reject(self, plan, knobs: Knobs, ctx) -> str | None:
        """Why a built plan is not a candidate after all (``None``: it is)."""
        return None

    @abstractmethod
    def simulate(self, plan, ctx):
        """The plan's simulation (step time, memory, ``feasible``)."""

    def refine(self, plan, sim, knobs: Knobs, ctx) -> tuple[Any, Any]:
        """A better plan for the same knobs, once simulated (default: the plan itself)."""
        return plan, sim

    @abstractmethod
    def record(self, knobs: Knobs, plan, sim) -> dict:
        """The record of a simulated candidate."""

    def infeasible_error(self, sim) -> str | None:
        """The error a simulation that does not fit leaves as the search's last error (``None``: none)."""
        return None

    @abstractmethod
    def summary(self, result: Outcome) -> dict:
        """The ``--json`` object of the planner CLI for ``result`` (docs/contracts.md)."""
