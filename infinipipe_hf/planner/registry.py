"""Every schedule by name: the pipeline schedules, then the non-pipeline alternatives.

The CLI's choices, the config's check, the search, the limits, the static settings and the
validator all find a schedule here.  Adding one is a module with its ``Schedule`` subclass
(:mod:`infinipipe_hf.planner.schedules.base`) and its entry below; the order of the entries is the
order of ``--schedule all`` within each kind.
"""
from __future__ import annotations

from infinipipe_hf.planner.alternatives.alst import ALSTSchedule
from infinipipe_hf.planner.alternatives.flexsp import FlexSPSchedule
from infinipipe_hf.planner.alternatives.ring_cp import RingCPSchedule
from infinipipe_hf.planner.alternatives.ring_cp_packed import PackedRingCPSchedule
from infinipipe_hf.planner.alternatives.ulysses_zero3 import UlyssesZero3Schedule
from infinipipe_hf.planner.schedules.base import PIPELINE, ROUNDS, Schedule
from infinipipe_hf.planner.schedules.epp import EPPSchedule
from infinipipe_hf.planner.schedules.gpipe import GPipeSchedule
from infinipipe_hf.planner.schedules.packed_1f1b import Packed1F1BSchedule
from infinipipe_hf.planner.schedules.seq1f1b import Seq1F1BSchedule

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    EPPSchedule(),
    Packed1F1BSchedule(),
    Seq1F1BSchedule(),
    GPipeSchedule(),
    UlyssesZero3Schedule(),
    RingCPSchedule(),
    PackedRingCPSchedule(),
    FlexSPSchedule(),
    ALSTSchedule(),
)}
PIPELINE_SCHEDULES = tuple(name for name, s in SCHEDULES.items() if s.kind == PIPELINE)
"""Schedules the runtime runs: a ``Plan`` of per-stage action lists."""
ALTERNATIVES = tuple(name for name, s in SCHEDULES.items() if s.kind == ROUNDS)
"""Non-pipeline schedules (a ``RoundPlan``), planned to be compared with."""
REFERENCE = next(name for name, s in SCHEDULES.items() if s.reference)
"""The schedule the others are compared with (elastic pipeline parallelism)."""


def get_schedule(name: str, kind: str | None = None) -> Schedule:
    """The schedule called ``name`` (of ``kind``, ``pipeline`` or ``rounds``, when given)."""
    names = [n for n, s in SCHEDULES.items() if kind is None or s.kind == kind]
    if name not in names:
        raise ValueError(f"schedule={name!r} is not known; use one of {', '.join(names)}")
    return SCHEDULES[name]
