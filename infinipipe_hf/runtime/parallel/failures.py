"""Who failed first: a small out-of-band status exchange over the launcher's key-value store.

Design: when one rank stops on an error of its own, its peers only see the consequence (a lost
connection, or a transfer that never completes), and would blame the wrong rank or report a
timeout that never happened.  So:
- a rank that fails on its own error publishes it (``publish_failure``: rank, error type and text)
  in the job's store before its process exits; the first one published stays ``first``;
- every rank beats a heartbeat counter in the store from a daemon thread (``start_heartbeat``);
  a rank that was killed or stopped (SIGSTOP) publishes nothing, but its counter stands still;
- a rank whose transfer or collective fails asks ``explain``: the first published failure, else
  the ranks whose heartbeat stood still, named the way the runtime names ranks;
- while a rank waits on its peers, the heartbeat thread also watches theirs (``peer_watch.py``,
  hooked in with ``on_beat``) and ends the wait once a peer's counter stood still for a while,
  well before the deadline.
The store is the one the launcher already runs (``MASTER_ADDR:MASTER_PORT``: torchrun's agent,
or rank 0 under a bare ``init_process_group``), reached through a client of its own with a short
timeout, so a diagnosis never blocks long.  Keys carry the restart count
(``TORCHELASTIC_RESTART_COUNT``): a restarted job never reads the failures of its previous attempt.

Trade-off: a diagnosis of a silent rank waits ``STALL_WINDOW_S`` to watch the heartbeats; it runs
only once something already failed.  Without a reachable store (another rendezvous), errors keep
their own text.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats of a rank."""
STALL_WINDOW_S = 4 * HEARTBEAT_S
"""How long a diagnosis watches the heartbeats; a counter unchanged over it is a stopped rank."""
STORE_TIMEOUT_S = 3.0
"""Deadline of one store operation made for a diagnosis."""
FIRST_WAIT_S = 1.0
"""How long a rank that lost a peer waits for that peer's own error to be published."""
STOPPED_KEY = "stopped"
"""Store key of the first stopped-rank verdict of a peer watch: every rank's watched wait ends on it."""

_PEER_TEXTS = ("connection closed", "connection reset", "connection refused", "broken pipe",
               "timed out", "timeout", "has died or is stuck", "lost the connection",
               "did not complete", "failed first", "has stopped")

_state: dict = {"store": None, "tried": False, "beat": None, "me": None}
_lock = threading.Lock()


def _store():
    """A client of the launcher's store with a short timeout, or ``None``."""
    with _lock:
        if _state["tried"]:
            return _state["store"]
        _state["tried"] = True
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (addr and port):
            return None
        try:
            import torch.distributed as dist

            client = dist.TCPStore(addr, int(port), is_master=False,
                                   timeout=timedelta(seconds=STORE_TIMEOUT_S))
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            _state["store"] = dist.PrefixStore(f"infinipipe_hf/status/{restart}/", client)
        except Exception:  # no reachable store: errors keep their own text
            _state["store"] = None
        return _state["store"]


def status_store():
    """The job's status store (a prefixed client of the launcher's store), or ``None``."""
    return _store()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def describe_rank(rank: int) -> str:
    return f"rank {rank}"


# --- publishing ----------------------------------------------------------------------------
def publish_failure(exc: BaseException, rank: int | None = None,
                    describe: Callable[[int], str] = describe_rank) -> None:
    """Record that ``rank`` (default: this process) stopped on ``exc``; the first record stays."""
    store = _store()
    if store is None:
        return
    rank = _rank() if rank is None else rank
    text = f"{describe(rank)} failed first: {type(exc).__name__}: {_one_line(exc)}"
    try:
        store.compare_set("first", "", text)
        store.set(f"failed/{rank}", text)
    except Exception:
        pass


def _one_line(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# --- heartbeats ------------------------------------------------------------------------------
def start_heartbeat(rank: int | None = None, on_beat: Callable[[], None] | None = None) -> bool:
    """Start this process's heartbeat thread once; False when no store is reachable.  ``on_beat``
    (if given) runs on that thread after every beat that reached the store."""
    store = _store()
    if store is None:
        return False
    with _lock:
        if on_beat is not None:
            _state["on_beat"] = on_beat
        if _state["beat"] is not None:
            return True
        _state["me"] = _rank() if rank is None else rank
        key, stop = f"beat/{_state['me']}", threading.Event()

        def beat() -> None:
            while not stop.is_set():
                try:
                    store.add(key, 1)
                    hook = _state.get("on_beat")
                    if hook is not None:
                        hook()
                except Exception:
                    pass  # a slow store: beat again (a thread that stopped would read as a stopped rank)
                stop.wait(HEARTBEAT_S)

        thread = threading.Thread(target=beat, name="infinipipe-heartbeat", daemon=True)
        thread.start()
        _state["beat"] = thread
        _state["stop"] = stop
        # Stopped before the interpreter exits: a thread caught inside a store call while the
        # store (hosted by rank 0 under some launchers) is torn down aborts the process.
        atexit.register(stop_heartbeat)
        return True


def heartbeat_rank() -> int | None:
    """The rank this process beats for, or ``None`` when no heartbeat runs here."""
    return _state["me"] if _state.get("beat") is not None else None


def stop_heartbeat() -> None:
    """Stop this process's heartbeat thread (if any) and wait for it briefly."""
    thread, stop = _state.get("beat"), _state.get("stop")
    if thread is None or stop is None:
        return
    stop.set()
    thread.join(timeout=STORE_TIMEOUT_S + 1)


def stalled_ranks(ranks: list[int], window_s: float = STALL_WINDOW_S) -> list[int]:
    """The ranks among ``ranks`` whose heartbeat stood still for ``window_s`` while this rank's
    advanced (empty when heartbeats are not running here)."""
    store = _store()
    if store is None or _state["beat"] is None:
        return []
    me = _state["me"]
    watch = sorted(set(ranks) | {me})
    try:
        before = {r: store.add(f"beat/{r}", 0) for r in watch}
        time.sleep(window_s)
        after = {r: store.add(f"beat/{r}", 0) for r in watch}
    except Exception:
        return []
    if after[me] == before[me]:
        return []  # our own heartbeat did not move: nothing can be concluded
    return [r for r in watch if r != me and before[r] > 0 and after[r] == before[r]]


# --- diagnosis --------------------------------------------------------------------------------
def first_failure(wait_s: float = FIRST_WAIT_S) -> str | None:
    """The first failure another rank published, waiting up to ``wait_s`` for one to appear."""
    store = _store()
    if store is None:
        return None
    deadline = time.perf_counter() + wait_s
    try:
        while True:
            if store.check(["first"]):
                return store.get("first").decode(errors="replace")
            if time.perf_counter() > deadline:
                return None
            time.sleep(0.05)
    except Exception:
        return None


def explain(ranks: list[int], describe: Callable[[int], str] = describe_rank) -> str:
    """What is known about why a transfer or collective over ``ranks`` failed: the first
    published failure, else the ranks whose heartbeat stopped; ``""`` when nothing is known."""
    known = first_failure()
    if known:
        return known
    silent = stalled_ranks(ranks)
    if not silent:
        return ""
    text = stopped_text(silent, describe, STALL_WINDOW_S)
    publish_stopped(text, every_wait=False)  # ranks that look later read it at once
    return text


def stopped_text(ranks: list[int], describe: Callable[[int], str], seconds: float) -> str:
    """How a stopped rank is named: ``rank 3 (stage 1, dp 1) has stopped: ...``."""
    names = ", ".join(describe(r) for r in ranks)
    return (f"{names} has stopped: its heartbeat stood still for {seconds:g} s (the process died, "
            f"was killed or stopped with SIGSTOP)")


def publish_stopped(text: str, every_wait: bool = True) -> None:
    """Record ``text`` as the first failure (unless one is known); ``every_wait``: also under
    :data:`STOPPED_KEY`, the verdict that ends every rank's watched wait (``peer_watch.py``)."""
    store = _store()
    if store is None:
        return
    try:
        store.compare_set("first", "", text)
        if every_wait:
            store.compare_set(STOPPED_KEY, "", text)
    except Exception:
        pass


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a lost peer or a deadline: a
    consequence of another rank's failure rather than a failure of this rank's own."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
            return True
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(t in text for t in _PEER_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def reporting_failures(rank: int, ranks: list[int],
                       describe: Callable[[int], str] = describe_rank) -> Iterator[None]:
    """Around a rank's work: publish its own errors for the others; a peer failure it sees is
    re-raised naming the rank that failed first (when known and not already named)."""
    try:
        yield
    except Exception as exc:
        if not is_peer_failure(exc):
            publish_failure(exc, rank, describe)
            raise
        text = str(exc)
        if "failed first" in text or "has stopped" in text:
            raise
        why = explain([r for r in ranks if r != rank], describe)
        if not why:
            raise
        raise RuntimeError(f"{describe(rank)}: {why}; this rank stopped with "
                           f"{type(exc).__name__}: {_one_line(exc)}") from exc
