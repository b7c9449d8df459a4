"""The peer watch on the heartbeat thread: a peer whose counter stands still for ``STALE_AFTER_S``
while this rank waits on it is named; a live one, one never started, or a gap in this rank's own
reading is not (store in this process, a hand-driven clock)."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf.runtime.parallel import failures, peer_watch  # noqa: E402
from infinipipe_hf.runtime.parallel.peer_watch import STALE_AFTER_S, WATCH_EVERY_S, PeerWatch, Wait  # noqa: E402


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(failures, "_state", {"store": None, "tried": False, "beat": None, "me": None})
    monkeypatch.setattr(peer_watch, "_slot", [None])
    yield failures.status_store()
    failures.stop_heartbeat()
    del master  # kept alive until the heartbeat stopped


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _register(peers, describe=lambda r: f"rank {r} (stage {r})") -> Wait:
    wait = Wait(tuple(peers), None, describe)
    peer_watch._slot[0] = wait
    return wait


def _run(watch: PeerWatch, clock: Clock, seconds: float, beat=None) -> None:
    """Tick every ``WATCH_EVERY_S`` for ``seconds``; ``beat(store)`` runs before each tick."""
    end = clock.t + seconds
    while clock.t <= end:
        if beat is not None:
            beat(watch.store)
        watch.tick()
        clock.t += WATCH_EVERY_S


def test_a_peer_that_stood_still_is_named_and_published(store):
    clock = Clock()
    watch = PeerWatch(store, clock)
    store.add("beat/1", 7)  # rank 1 beat, then stopped
    store.add("beat/2", 3)
    wait = _register([1, 2])
    _run(watch, clock, STALE_AFTER_S - WATCH_EVERY_S - 0.5, beat=lambda s: s.add("beat/2", 1))
    assert wait.verdict is None  # not yet: the window is not over
    _run(watch, clock, 2 * WATCH_EVERY_S, beat=lambda s: s.add("beat/2", 1))
    assert wait.verdict is not None and wait.verdict.startswith("rank 1 (stage 1) has stopped: its heartbeat "
                                                                 f"stood still for {STALE_AFTER_S:g} s"), wait.verdict
    assert "rank 2" not in wait.verdict  # alive: it kept beating
    assert store.get(failures.STOPPED_KEY).decode() == wait.verdict
    assert failures.first_failure(wait_s=0.0) == wait.verdict


def test_a_live_peer_that_beats_is_never_named(store):
    clock = Clock()
    watch = PeerWatch(store, clock)
    store.add("beat/1", 1)
    wait = _register([1])
    _run(watch, clock, 3 * STALE_AFTER_S, beat=lambda s: s.add("beat/1", 1))
    assert wait.verdict is None
    assert not store.check([failures.STOPPED_KEY])


def test_a_rank_that_never_beat_is_not_judged(store):
    clock = Clock()
    watch = PeerWatch(store, clock)
    wait = _register([4])  # still loading its model: no heartbeat yet
    _run(watch, clock, 2 * STALE_AFTER_S)
    assert wait.verdict is None


def test_a_gap_in_this_ranks_own_reading_starts_a_new_watch(store):
    """This process itself stopped (or waited on nobody) for a while: the gap is not the peer's."""
    clock = Clock()
    watch = PeerWatch(store, clock)
    store.add("beat/1", 5)
    wait = _register([1])
    _run(watch, clock, STALE_AFTER_S / 2)
    clock.t += peer_watch.FORGET_AFTER_S + 1  # no reading over the gap
    _run(watch, clock, STALE_AFTER_S / 2)
    assert wait.verdict is None
    _run(watch, clock, STALE_AFTER_S / 2 + WATCH_EVERY_S)
    assert wait.verdict is not None  # watched continuously for a whole window now


def test_another_ranks_verdict_ends_a_wait_on_live_peers(store):
    clock = Clock()
    watch = PeerWatch(store, clock)
    store.add("beat/2", 1)
    wait = _register([2])
    failures.publish_stopped("rank 3 (stage 1, dp 1) has stopped: its heartbeat stood still for 30 s")
    watch.tick()
    assert wait.verdict.startswith("rank 3 (stage 1, dp 1) has stopped")


def test_a_diagnosis_after_a_failure_does_not_end_other_waits(store):
    """``explain`` names a stalled rank as the first failure only; the watch's key stays unset."""
    failures.publish_stopped("rank 3 has stopped: ...", every_wait=False)
    assert failures.first_failure(wait_s=0.0) == "rank 3 has stopped: ..."
    assert not store.check([failures.STOPPED_KEY])


def test_without_a_heartbeat_nothing_is_registered(store):
    with peer_watch.watching([1, 2]) as wait:
        assert wait is None and peer_watch._slot[0] is None


def test_with_a_heartbeat_the_wait_is_registered_for_its_body(store):
    assert peer_watch.start(0)
    with peer_watch.watching([0, 1, 2], describe=str) as wait:
        assert peer_watch._slot[0] is wait and wait.peers == (1, 2)  # never itself
    assert peer_watch._slot[0] is None


def test_a_heartbeat_keeps_beating_through_a_failing_hook(store):
    """A hook that raises (a slow store) must not stop the beat: peers would call this rank stopped."""
    calls = []

    def hook():
        calls.append(1)
        raise RuntimeError("store timed out")

    assert failures.start_heartbeat(0, on_beat=hook)
    import time

    time.sleep(4 * failures.HEARTBEAT_S)
    assert len(calls) >= 2 and int(store.add("beat/0", 0)) >= 2


def test_a_wait_released_by_another_ranks_verdict_reads_it(store):
    """Another rank's release closed this rank's pairs before this watch concluded."""
    wait = Wait((2,), None, str)
    assert peer_watch.verdict_of(wait) is None and peer_watch.verdict_of(None) is None
    failures.publish_stopped("rank 3 (stage 1, dp 1) has stopped: its heartbeat stood still for 30 s")
    assert peer_watch.verdict_of(wait).startswith("rank 3 (stage 1, dp 1) has stopped")


class _PendingWork:
    def is_completed(self):
        return False


def test_a_verdict_ends_a_polled_wait_and_names_the_stopped_peer():
    """The waiter's side (``comm.py``): polling ends on the verdict; the error carries it, not a timeout."""
    import time

    from infinipipe_hf.layout import ParallelDims
    from infinipipe_hf.runtime.parallel.comm import HIDDEN, StageComm, Transfer, poll_completion
    from infinipipe_hf.runtime.parallel.mesh import ParallelLayout

    verdict = "rank 0 (stage 0, dp 0) has stopped: its heartbeat stood still for 30 s"
    wait = Wait((0,), None, str, verdict=verdict)
    with pytest.raises(RuntimeError, match="a peer has stopped"):
        poll_completion(_PendingWork(), time.perf_counter() + 60, wait)
    with pytest.raises(RuntimeError, match="timed out"):
        poll_completion(_PendingWork(), time.perf_counter() + 0.01, Wait((0,), None, str))
    layout = ParallelLayout(ParallelDims(pp_degree=2), 1, timeout_s=1800, groups_enabled=False)
    comm = StageComm(layout, timeout_s=1800, device=torch.device("cpu"), dtype=torch.float32)
    t = Transfer(_PendingWork(), torch.empty(2), 0, HIDDEN, 3, True, time.perf_counter())
    msg = comm._failure_message(t, 7, "F3", RuntimeError("Application timeout caused pair closure"), wait)
    assert msg == ("rank 1 (stage 1, dp 0): step 7, action F3: waiting for the hidden states of unit 3 "
                   f"from rank 0 (stage 0, dp 0): {verdict}")
