"""Replay of a plan whose ranks share a few cores (processor sharing), for CPU runs.

:func:`replay.replay` gives every stage a device of its own: an action runs at full speed from
the moment its stage is free and its input has arrived.  Several single-threaded ranks on a
machine with fewer cores than ranks do not behave like that: while ``n`` ranks compute on ``c``
cores, each gets ``min(1, c / n)`` of a core (Linux's fair scheduler shares a core equally among
runnable threads of equal weight; a rank blocked on a receive does not compete).  Here every
action carries its *work* (seconds at full speed, the cost model's time) and runs at that shared
rate, which changes whenever an action starts or ends somewhere, so the replay is event driven:
advance to the earliest of (an action finishing at the current rate, an input arriving),
subtract ``rate x dt`` from every running action's work, start what became ready, repeat.

All DP replicas of a plan share the machine, so they are replayed together; a stage of
``ranks_per_stage`` SP ranks runs each action on all of them at once (they move in lockstep
between all-to-alls), so one running action counts that many busy ranks.  Transfers are pure
delays here; the CPU gloo's threads spend on a message is the caller's to add to the work of
the actions at its two ends (``action_costs.ActionCosts.shared_work``).

``pinned``: every rank is pinned to one core, global rank ``(dp * pp + stage) * sp + sp_rank`` on
core ``rank % cores`` (how ``benchmarks/runtime_worker.py`` pins them); a core is then shared only
among the busy ranks pinned to it, and a stage of SP ranks on several cores advances at its
slowest rank's share.  Left unpinned, the kernel moves ranks between cores and may leave one idle
while a woken rank waits on the other, which ideal sharing of all cores cannot see (measured:
docs/simulator_vs_real.md); pinned, what the replay assumes is what the machine does.

Trade-off: the model is the ideal of fair sharing: no context-switch cost, no cache or
memory-bandwidth interference between ranks, and no other jobs on the machine (those are
measured beside it, as load, not modelled).  With ``cores >= ranks`` it reduces exactly to
:func:`replay.replay`.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.planner.simulate.replay import ReplayResult, input_of

_EPS = 1e-12


def shared_replay(replicas: Sequence[Sequence[Sequence[Action]]], duration: Callable[[int, Action], float],
                  transfer: Callable[[Action], float], *, cores: float, ranks_per_stage: int = 1,
                  pinned: bool = False) -> list[ReplayResult]:
    """Replay every replica's ``stage_actions`` on ``cores`` shared cores (module docstring).

    ``duration(stage, action)`` is the action's work at full speed, ``transfer(action)`` the delay
    between neighbouring stages.  Returns one :class:`ReplayResult` per replica (wall-clock start and
    end of every action; an incomplete one when the plan deadlocks)."""
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores!r}")
    if int(ranks_per_stage) != ranks_per_stage or ranks_per_stage < 1:
        raise ValueError(f"ranks_per_stage must be a positive integer, got {ranks_per_stage!r}")
    lane_cores = _pinned_cores(replicas, cores, ranks_per_stage) if pinned else None
    return _SharedReplay(replicas, duration, transfer, cores, ranks_per_stage, lane_cores).run()


Lane = tuple[int, int]
"""(replica, stage)."""


def _pinned_cores(replicas: Sequence[Sequence[Sequence[Action]]], cores: float,
                  ranks_per_stage: int) -> dict[Lane, list[int]]:
    """The cores of each lane's ranks: global rank ``(dp * pp + stage) * sp + sp_rank`` runs on
    core ``rank % cores``."""
    ncores = int(cores)
    if ncores != cores:
        raise ValueError(f"pinned ranks need a whole number of cores, got {cores!r}")
    pp = {len(stages) for stages in replicas}
    assert len(pp) == 1, "replicas of one plan have the same number of stages"
    width = pp.pop() * ranks_per_stage
    return {(r, s): [((r * width) + s * ranks_per_stage + k) % ncores for k in range(ranks_per_stage)]
            for r, stages in enumerate(replicas) for s in range(len(stages))}


class _SharedReplay:
    """The event-driven replay's state: per lane its next action, running work and input waits."""

    def __init__(self, replicas, duration, transfer, cores: float, ranks_per_stage: int,
                 lane_cores: dict[Lane, list[int]] | None):
        self.replicas, self.duration, self.transfer = replicas, duration, transfer
        self.cores, self.ranks_per_stage, self.lane_cores = cores, ranks_per_stage, lane_cores
        self.lanes = [(r, s) for r, stages in enumerate(replicas) for s in range(len(stages))]
        self.starts = [[[0.0] * len(a) for a in stages] for stages in replicas]
        self.ends = [[[0.0] * len(a) for a in stages] for stages in replicas]
        self.done = [[0] * len(stages) for stages in replicas]
        self.free = {lane: 0.0 for lane in self.lanes}
        self.finished: dict[tuple[int, int, str, int], float] = {}
        self.running: dict[Lane, float] = {}  # lane -> work left (seconds at full speed)
        self.waiting: list[tuple[float, Lane]] = []  # (ready time, lane): input known, in flight
        self.queued: set[Lane] = set()
        self.now = 0.0

    def rates(self) -> dict[Lane, float]:
        """Share of a core each running lane gets now."""
        running = self.running
        if self.lane_cores is None:
            busy = len(running) * self.ranks_per_stage
            rate = min(1.0, self.cores / busy) if busy else 1.0
            return {lane: rate for lane in running}
        load: dict[int, int] = {}
        for lane in running:
            for c in self.lane_cores[lane]:
                load[c] = load.get(c, 0) + 1
        # SP ranks of a stage move in lockstep: the action advances at its slowest rank's share.
        return {lane: min(1.0 / load[c] for c in self.lane_cores[lane]) for lane in running}

    def try_schedule(self, lane: Lane) -> None:
        """Start the lane's next action now, or queue it for when its input arrives."""
        r, s = lane
        acts = self.replicas[r][s]
        i = self.done[r][s]
        if lane in self.running or lane in self.queued or i >= len(acts):
            return
        a = acts[i]
        dep = input_of(a, s, len(self.replicas[r]))
        ready = self.free[lane]
        if dep is not None:
            got = self.finished.get((r, dep[0], dep[1], a.unit))
            if got is None:
                return  # its input does not exist yet; the producer's completion reschedules it
            ready = max(ready, got + (self.transfer(a) if dep[0] != s else 0.0))
        if ready <= self.now + _EPS:
            self.starts[r][s][i] = self.now
            self.running[lane] = max(self.duration(s, a), 0.0)
        else:
            self.queued.add(lane)
            heapq.heappush(self.waiting, (ready, lane))

    def advance(self) -> list[Lane]:
        """Move time to the next completion or arrival; returns the lanes whose action completed."""
        running, waiting = self.running, self.waiting
        rate = self.rates()
        next_end = min((self.now + w / rate[lane] for lane, w in running.items()), default=float("inf"))
        next_ready = waiting[0][0] if waiting else float("inf")
        t = min(next_end, next_ready)
        dt = t - self.now
        self.now = now = t
        completed = []
        for lane in list(running):
            running[lane] -= rate[lane] * dt
            if running[lane] <= _EPS * max(1.0, now):
                completed.append(lane)
        for lane in completed:
            del running[lane]
            r, s = lane
            i = self.done[r][s]
            a = self.replicas[r][s][i]
            self.ends[r][s][i] = self.free[lane] = now
            self.finished[(r, s, a.kind, a.unit)] = now
            self.done[r][s] = i + 1
        while waiting and waiting[0][0] <= now + _EPS:
            _, lane = heapq.heappop(waiting)
            self.queued.discard(lane)
            r, s = lane
            self.starts[r][s][self.done[r][s]] = now
            running[lane] = max(self.duration(s, self.replicas[r][s][self.done[r][s]]), 0.0)
        return completed

    def run(self) -> list[ReplayResult]:
        for lane in self.lanes:
            self.try_schedule(lane)
        while self.running or self.waiting:
            # Completions free their own stage and may feed a neighbour of the same replica.
            for r, s in self.advance():
                for nb in (s - 1, s, s + 1):
                    if 0 <= nb < len(self.replicas[r]):
                        self.try_schedule((r, nb))
        out = []
        for r, stages in enumerate(self.replicas):
            st = [row[:self.done[r][s]] for s, row in enumerate(self.starts[r])]
            en = [row[:self.done[r][s]] for s, row in enumerate(self.ends[r])]
            out.append(ReplayResult(st, en, list(self.done[r]), [len(a) for a in stages]))
        return out
