"""A stopped peer ends a rank's wait within seconds: heartbeats decide, the deadline only bounds.

Design: every transfer and collective has a deadline (``ddp_timeout``: 30 minutes by default),
but a rank that was killed or stopped (SIGSTOP) is known much sooner: its heartbeat counter in
the launcher's store stands still (``failures.py``).  So a rank registers each wait with the
peers it waits on and their process group (``watching``).  While a wait is registered, the
heartbeat thread (which beats every ``HEARTBEAT_S`` anyway) reads those peers' counters every
``WATCH_EVERY_S``.  A peer whose counter has not moved for ``STALE_AFTER_S`` is stopped: the
thread puts the verdict on the wait, publishes it (``failures.publish_stopped``: a rank whose
wait is on a live peer that itself waits on the stopped one ends on it too) and releases the
blocked wait.  A gloo wait can neither be polled (a point-to-point work reports completion only
inside ``wait``) nor retried after a timed-out wait (gloo then closes the pair), so the release
posts a receive from each peer of the wait's group that times out at once: gloo closes those
pairs, the blocked wait raises, and the waiter reads the verdict (``comm.py``).  Waits on other
backends poll completion and read the verdict themselves; nothing is released for them.

Trade-offs: a wait shorter than ``STALE_AFTER_S`` is never judged, so a fast transfer pays two
attribute stores; a live rank keeps beating while it computes (the heartbeat is a daemon thread
and torch's kernels release the GIL), so only a process that does not run at all is called
stopped.  Without heartbeats (no store, a world of one) ``watching`` registers nothing and every
wait behaves as its deadline says.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

from infinipipe_hf.runtime.parallel import failures

STALE_AFTER_S = 30.0
"""A peer whose heartbeat counter has not moved for this long while this rank waited on it has
stopped (SIGSTOP, killed, or a machine gone).  Far above any pause of a live rank's heartbeat
thread (it beats every ``failures.HEARTBEAT_S``), far below the default ``ddp_timeout``."""
WATCH_EVERY_S = 2.0
"""How often the heartbeat thread reads the counters of the peers of a registered wait."""
FORGET_AFTER_S = 10.0
"""A counter last read longer ago than this (no wait on that peer since, or this process was
itself stopped) starts a new watch instead of counting the gap as standing still."""
RELEASE_TAG = (1 << 30) + 17
"""Tag of the receive that releases a blocked gloo wait; no rank ever sends with it."""
RELEASE_TIMEOUT_S = 0.01
"""Deadline of that receive: its timeout is what makes gloo close the pair."""


@dataclass
class Wait:
    """One registered wait: the peers (global ranks) it waits on, their group, and the verdict."""

    peers: tuple[int, ...]
    group: Any
    """Process group of the wait (``None``: the default group)."""
    describe: Callable[[int], str]
    verdict: str | None = None
    """Set by the heartbeat thread when a peer has stopped: why the wait ended."""


_slot: list[Wait | None] = [None]
"""The wait the main thread is blocked in (one slot: waits do not nest across threads)."""


@contextmanager
def watching(peers, group: Any = None,
             describe: Callable[[int], str] = failures.describe_rank) -> Iterator[Wait | None]:
    """Register the body as a wait on ``peers`` over ``group``; yields the ``Wait`` (its
    ``verdict`` says why it ended early) or ``None`` when no heartbeat runs here."""
    me = failures.heartbeat_rank()
    if me is None:
        yield None
        return
    wait = Wait(tuple(p for p in peers if p != me), group, describe)
    previous, _slot[0] = _slot[0], wait
    try:
        yield wait
    finally:
        _slot[0] = previous


def verdict_of(wait: Wait | None) -> str | None:
    """Why ``wait`` ended, when a stopped rank ended it: its own verdict, else one another rank
    published (that rank's release closed this rank's pairs before this watch concluded)."""
    if wait is None:
        return None
    if wait.verdict:
        return wait.verdict
    store = failures.status_store()
    try:
        if store is not None and store.check([failures.STOPPED_KEY]):
            return store.get(failures.STOPPED_KEY).decode(errors="replace")
    except Exception:
        pass
    return None


def start(rank: int) -> bool:
    """Start this rank's heartbeat with the peer watch on its thread; False without a store."""
    store = failures.status_store()
    if store is None:
        return False
    return failures.start_heartbeat(rank, on_beat=PeerWatch(store).tick)


def read_counters(store, ranks: tuple[int, ...]) -> dict[int, int]:
    """Heartbeat counters of ``ranks`` (0: never beat); one round trip when all exist."""
    keys = [f"beat/{r}" for r in ranks]
    if keys and store.check(keys):
        return {r: int(v) for r, v in zip(ranks, store.multi_get(keys))}
    return {r: store.add(k, 0) for r, k in zip(ranks, keys)}


class PeerWatch:
    """Runs on the heartbeat thread: judges the peers of the registered wait (module docstring)."""

    def __init__(self, store, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self.seen: dict[int, list[float]] = {}
        """rank -> [counter, since when it stood at that value, when it was last read]."""
        self.last_read = -math.inf

    def tick(self) -> None:
        """One look at the registered wait, at most every ``WATCH_EVERY_S``."""
        wait, now = _slot[0], self.clock()
        if wait is None or wait.verdict is not None or now - self.last_read < WATCH_EVERY_S:
            return
        self.last_read = now
        verdict = self.judge(wait, now)
        if verdict is None or wait is not _slot[0]:
            return  # alive, or that wait already returned
        wait.verdict = verdict
        failures.publish_stopped(verdict)
        release(wait)

    def judge(self, wait: Wait, now: float) -> str | None:
        """The verdict on ``wait``: another rank's published one, or this rank's own; else None."""
        try:
            if self.store.check([failures.STOPPED_KEY]):
                return self.store.get(failures.STOPPED_KEY).decode(errors="replace")
            counters = read_counters(self.store, wait.peers)
        except Exception:  # a slow or vanished store proves nothing
            return None
        stale = [r for r, c in counters.items() if self._stood_still(r, c, now)]
        return failures.stopped_text(stale, wait.describe, STALE_AFTER_S) if stale else None

    def _stood_still(self, rank: int, counter: int, now: float) -> bool:
        seen = self.seen.get(rank)
        if seen is None or counter != seen[0] or now - seen[2] > FORGET_AFTER_S:
            self.seen[rank] = [counter, now, now]
            return False
        seen[2] = now
        return counter > 0 and now - seen[1] >= STALE_AFTER_S


def release(wait: Wait) -> None:
    """Make a blocked gloo wait of ``wait`` raise: a receive from each peer over its group that
    times out at once, on which gloo closes the pair (other backends are polled; nothing to do)."""
    import torch
    import torch.distributed as dist

    try:
        if "gloo" not in str(dist.get_backend(wait.group)):
            return
    except Exception:
        return
    works = []
    for peer in wait.peers:
        try:
            works.append(dist.irecv(torch.empty(1), src=peer, group=wait.group, tag=RELEASE_TAG))
        except Exception:  # not a member of that group: nothing to close
            continue
    for work in works:
        try:
            work.wait(timeout=timedelta(seconds=RELEASE_TIMEOUT_S))
        except Exception:
            pass
