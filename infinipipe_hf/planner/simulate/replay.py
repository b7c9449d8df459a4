"""Dependency-driven replay of one DP replica's stage action lists.

Design: every stage runs its list in order; an action starts when its stage is free and its
input has arrived: ``F<u>`` on stage ``s`` needs ``F<u>`` on ``s - 1`` (plus a transfer),
``B<u>`` on ``s`` needs ``B<u>`` on ``s + 1`` (plus a transfer), and on the last stage its own
``F<u>``.  The simulator replays with cost-model durations; the validator replays with unit
durations to get the time slots of its stage-by-time grid and to detect deadlocks (a replay that
stops with actions left).

Trade-off: stages are swept round-robin until no action can start, O(stages x actions) in the
worst case, instead of a priority queue of events; start times do not depend on the sweep order
(each is a max over its stage predecessor and its one input), and plans have at most a few
thousand actions per stage, so the simple sweep is fast enough and easy to trust.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from infinipipe_hf.ir.actions import Action


@dataclass
class ReplayResult:
    start: list[list[float]]
    """start[stage][i]: start time of the stage's i-th action (only the first ``done[stage]``)."""
    end: list[list[float]]
    done: list[int]
    """Actions completed per stage; fewer than ``totals[stage]`` means the replay got stuck."""
    totals: list[int]

    @property
    def complete(self) -> bool:
        return self.done == self.totals

    def stuck(self, stage_actions: Sequence[Sequence[Action]]) -> list[tuple[int, int]]:
        """(stage, action index) of the next action of every stage that could not start."""
        return [(s, d) for s, d in enumerate(self.done) if d < len(stage_actions[s])]


def input_of(action: Action, stage: int, num_stages: int) -> tuple[int, str] | None:
    """(stage, kind) of the action whose output ``action`` consumes, or None for none."""
    if action.is_forward:
        return (stage - 1, "F") if stage > 0 else None
    return (stage + 1, "B") if stage < num_stages - 1 else (stage, "F")


def replay(stage_actions: Sequence[Sequence[Action]], duration: Callable[[int, Action], float],
           transfer: Callable[[Action], float]) -> ReplayResult:
    """Replay ``stage_actions[stage]`` (one replica) with ``duration(stage, action)`` seconds each and
    ``transfer(action)`` seconds between neighbouring stages."""
    p = len(stage_actions)
    start: list[list[float]] = [[0.0] * len(a) for a in stage_actions]
    end: list[list[float]] = [[0.0] * len(a) for a in stage_actions]
    done = [0] * p
    free = [0.0] * p
    finished: dict[tuple[int, str, int], float] = {}
    progress = True
    while progress:
        progress = False
        for s in range(p):
            acts = stage_actions[s]
            i = done[s]
            while i < len(acts):
                a = acts[i]
                dep = input_of(a, s, p)
                ready = free[s]
                if dep is not None:
                    got = finished.get((dep[0], dep[1], a.unit))
                    if got is None:
                        break
                    ready = max(ready, got + (transfer(a) if dep[0] != s else 0.0))
                start[s][i] = ready
                free[s] = end[s][i] = ready + duration(s, a)
                finished[(s, a.kind, a.unit)] = free[s]
                i += 1
                progress = True
            done[s] = i
    for s in range(p):
        del start[s][done[s]:]
        del end[s][done[s]:]
    return ReplayResult(start, end, done, [len(a) for a in stage_actions])
