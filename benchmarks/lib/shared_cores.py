"""CPU runs whose ranks share a few cores: the setting, its replay, its cost model and its profile files.

The package's simulator gives every stage a device of its own (:func:`replay.replay`): an action
runs at full speed from the moment its stage is free and its input has arrived.  Several
single-threaded ranks on a machine with fewer cores than ranks do not behave like that: while
``n`` ranks compute on ``c`` cores, each gets ``min(1, c / n)`` of a core (Linux's fair scheduler
shares a core equally among runnable threads of equal weight; a rank blocked on a receive does
not compete).  :func:`shared_replay` gives every action its *work* (seconds at full speed, the
cost model's time) and runs it at that shared rate, which changes whenever an action starts or
ends somewhere, so the replay is event driven: advance to the earliest of (an action finishing at
the current rate, an input arriving), subtract ``rate x dt`` from every running action's work,
start what became ready, repeat.

All DP replicas of a plan share the machine, so they are replayed together; a stage of
``ranks_per_stage`` SP ranks runs each action on all of them at once (they move in lockstep
between all-to-alls), so one running action counts that many busy ranks.  Transfers are pure
delays here; the CPU gloo's threads spend on a message is added to the work of the actions at its
two ends (``ActionCosts.shared_work``).

``pinned``: every rank is pinned to one core, global rank ``(dp * pp + stage) * sp + sp_rank`` on
core ``rank % cores`` (what ``runtime_worker.pin_to_core`` does); a core is then shared only among
the busy ranks pinned to it, and a stage of SP ranks on several cores advances at its slowest
rank's share.  Left unpinned, the kernel moves ranks between cores and may leave one idle while a
woken rank waits on the other, which ideal sharing of all cores cannot see (measured:
docs/simulator_vs_real.md); pinned, what the replay assumes is what the machine does.

The simulator reaches this through its extension point: :class:`SharedCoresCost` is a
``CostModel`` with a ``replica_replay``.  Benchmark profile files carry the setting beside the
profile's fields (keys ``shared_cores``, ``pinned_ranks``): :func:`load_profile` splits them,
:func:`save_profile` joins them, and :func:`engine_profile` / :class:`SharedCoresPlanner` let a
``PipelineEngine`` in a gloo worker plan with them.

Trade-off: the model is the ideal of fair sharing: no context-switch cost, no cache or
memory-bandwidth interference between ranks, and no other jobs on the machine (those are measured
beside it, as load, not modelled).  With ``cores >= ranks`` it reduces exactly to :func:`replay.replay`.
"""
from __future__ import annotations

import heapq
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile
from infinipipe_hf.planner.simulate.replay import ReplayResult, input_of

KEYS = ("shared_cores", "pinned_ranks")
"""The keys of a benchmark profile file that hold :class:`SharedCores` (not ``HardwareProfile`` fields)."""

_EPS = 1e-12


@dataclass(frozen=True)
class SharedCores:
    """How the ranks of a CPU run share the machine's cores."""

    cores: float
    """Cores all ranks of the run share (file key ``shared_cores``)."""
    pinned: bool = False
    """Every rank pinned to one core, global rank ``r`` on core ``r % cores`` (file key
    ``pinned_ranks``); False: the kernel places the ranks, all cores shared among all busy ranks."""

    def __post_init__(self) -> None:
        if not self.cores > 0:
            raise ValueError(f"shared_cores must be > 0 (cores the ranks share; leave the setting out when "
                             f"every rank has a device), got {self.cores!r}")
        if self.pinned and int(self.cores) != self.cores:
            raise ValueError(f"pinned_ranks needs shared_cores to be a whole number of cores (ranks are pinned "
                             f"to cores), got shared_cores={self.cores!r}")

    @staticmethod
    def fields(shared: "SharedCores | None") -> dict[str, Any]:
        """The file keys of ``shared`` (``None``: no sharing, ``shared_cores`` 0)."""
        return {"shared_cores": float(shared.cores) if shared else 0.0, "pinned_ranks": bool(shared and shared.pinned)}


class SharedCoresCost(CostModel):
    """A :class:`CostModel` whose plans run on shared cores: the simulator replays all replicas
    together through :meth:`replica_replay`.  Sub-group costs (``for_group``) stay plain: they
    price single actions, which sharing does not change."""

    shared: SharedCores

    def __init__(self, *args, shared: SharedCores, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shared = shared

    @classmethod
    def of(cls, cost: CostModel, shared: SharedCores) -> "SharedCoresCost":
        """``cost``'s stage context (model, profile, layout, split, budget) on ``shared`` cores."""
        out = cls.of_context(cost.ctx)
        out.shared = shared
        return out

    def replica_replay(self, plan, costs, lists: Mapping[int, Sequence[Sequence[Action]]]) -> dict[int, ReplayResult]:
        """Every replica's replay of its stage lists ``lists`` on the shared cores; an action's work
        is its compute plus its share of its messages' CPU (``costs.shared_work``)."""
        replicas = sorted(lists)
        return dict(zip(replicas, shared_replay([lists[r] for r in replicas], costs.shared_work, costs.transfer,
                                                cores=float(self.shared.cores), ranks_per_stage=plan.sp_degree,
                                                pinned=self.shared.pinned)))


def with_shared_cores(cost: CostModel, shared: SharedCores | None) -> CostModel:
    """``cost`` on ``shared`` cores, or ``cost`` itself when every rank has a device (``None``)."""
    return cost if shared is None else SharedCoresCost.of(cost, shared)


def split_profile(data: Mapping[str, Any]) -> tuple[HardwareProfile, SharedCores | None]:
    """A benchmark profile document as ``(profile, setting)``: the setting is ``None`` when the
    document has no ``shared_cores`` or sets it to 0 (a device per rank)."""
    kw = dict(data)
    cores, pinned = float(kw.pop("shared_cores", 0.0) or 0.0), bool(kw.pop("pinned_ranks", False))
    if pinned and not cores:
        raise ValueError("pinned_ranks needs shared_cores to be a whole number of cores (ranks are pinned to cores), "
                         "got shared_cores=0; set shared_cores or drop pinned_ranks")
    return HardwareProfile.from_dict(kw), (SharedCores(cores, pinned) if cores else None)


def load_profile(path: str | Path) -> tuple[HardwareProfile, SharedCores | None]:
    """:func:`split_profile` of the JSON file at ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"profile file {path} does not exist; fit one with `python -m benchmarks.cpu.cpu_profile` "
                         f"or pass the .profile.json a CPU benchmark saved") from None
    return split_profile(data)


def device_profile(path: str | Path) -> HardwareProfile:
    """The profile at ``path`` for a run that gives every rank a device (GPU benchmarks): files
    written with the setting's keys load when they say no sharing; a ``ValueError`` when they share cores."""
    profile, shared = load_profile(path)
    if shared is not None:
        raise ValueError(f"profile {path} says its ranks share {shared.cores:g} cores (a CPU run's profile); this "
                         f"benchmark gives every rank a device of its own: pass a profile measured on the device")
    return profile


def profile_dict(profile: HardwareProfile, shared: SharedCores | None) -> dict[str, Any]:
    """The benchmark profile document: the profile's fields plus the setting's keys."""
    return {**profile.to_dict(), **SharedCores.fields(shared)}


def save_profile(path: str | Path, profile: HardwareProfile, shared: SharedCores | None) -> None:
    Path(path).write_text(json.dumps(profile_dict(profile, shared), indent=1))


def engine_profile(path: str | None, directory: str | Path) -> tuple[str | None, SharedCores | None]:
    """``(a profile path InfiniPipeConfig can load, the setting)`` of the benchmark profile at
    ``path``: a file with the setting's keys is copied without them into ``directory``."""
    if path is None:
        return None, None
    data = json.loads(Path(path).read_text())
    if not any(k in data for k in KEYS):
        return path, None
    _, shared = split_profile(data)
    fd, plain = tempfile.mkstemp(suffix=".profile.json", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump({k: v for k, v in data.items() if k not in KEYS}, f)
    return plain, shared


class SharedCoresPlanner:
    """A ``PipelineEngine`` planner: the engine's own default request (its profile, layout,
    budget, split and options), priced on ``shared`` cores."""

    def __init__(self, shared: SharedCores) -> None:
        self.shared = shared

    def __call__(self, lengths: list[int], engine):
        from infinipipe_hf.planner.search.api import plan_step

        request = engine.default_planner.request(engine)
        spec, dims, options = request["spec"], request["dims"], request["options"]
        return plan_step(lengths, spec, dims, options, cost=SharedCoresCost.of(options.cost(spec, dims), self.shared))


def engine_planner(shared: SharedCores | None) -> SharedCoresPlanner | None:
    """The ``planner=`` argument of a ``PipelineEngine`` on ``shared`` cores (``None``: its default)."""
    return None if shared is None else SharedCoresPlanner(shared)


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
