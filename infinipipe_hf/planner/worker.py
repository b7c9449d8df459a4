"""``plan_step`` in a separate Python process, so planning never holds the caller's GIL.

The trainer plans the next batch while the current one trains.  On a thread the planner (pure
Python) competes with the training loop for the GIL; in its own process it runs on another core
and only the request and the result cross a pipe.  Requests are ``plan_step`` keyword arguments
(plain data: the model spec, the profile, degrees, budgets), so a plan made here is the plan the
caller would have made itself.

The child is started with ``python -m`` (not ``multiprocessing``), so it never re-imports the
user's training script; it imports only the planner (no torch).  It exits when its stdin closes,
so it cannot outlive its parent.  Warnings raised while planning travel back with the result and
are re-raised in the caller, where its warning filters apply.
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("planner process closed its pipe")
    (size,) = _HEADER.unpack(head)
    return pickle.loads(stream.read(size))


def reraise_warnings(caught: list[tuple[str, str]]) -> None:
    """Re-raise warnings recorded in the planner process (``(category name, message)`` pairs)."""
    categories = {c.__name__: c for c in (UserWarning, RuntimeWarning, FutureWarning, DeprecationWarning)}
    for name, message in caught:
        warnings.warn(message, categories.get(name, UserWarning), stacklevel=3)


class PlannerProcess:
    """One child process that runs ``plan_step(lengths, **kwargs)`` requests in order."""

    def __init__(self) -> None:
        self._child = subprocess.Popen([sys.executable, "-m", "infinipipe_hf.planner.worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="epp-plan-reader", daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(self, _stop, self._child)

    def submit(self, lengths: list[int], kwargs: dict) -> Future:
        """A future of ``(PlanResult, warnings)`` for ``plan_step(lengths, **kwargs)``."""
        future: Future = Future()
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[request_id] = future
            try:
                _send(self._child.stdin, (request_id, list(lengths), kwargs))
            except (OSError, ValueError) as e:  # a broken pipe, or a closed one
                self._pending.pop(request_id)
                future.set_exception(RuntimeError(f"the planner process is gone ({e})"))
        return future

    def _read(self) -> None:
        try:
            while True:
                request_id, ok, value, caught = _receive(self._child.stdout)
                with self._lock:
                    future = self._pending.pop(request_id)
                if ok:
                    future.set_result((value, caught))
                else:
                    future.set_exception(value)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            with self._lock:
                pending, self._pending = self._pending, {}
            for future in pending.values():
                future.set_exception(RuntimeError(f"the planner process ended ({e})"))

    def close(self) -> None:
        self._finalizer()


def _stop(child: subprocess.Popen) -> None:
    try:
        child.stdin.close()
        child.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        child.kill()


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    from infinipipe_hf.planner.search.api import plan_step

    while True:
        try:
            request_id, lengths, kwargs = _receive(requests)
        except EOFError:
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                reply = (True, plan_step(lengths, **kwargs))
            except Exception as e:  # noqa: BLE001 - every planner error goes back to the caller
                reply = (False, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
        notes = [(type(w.message).__name__, str(w.message)) for w in caught]
        _send(replies, (request_id, *reply, notes))


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:  # noqa: BLE001
        return False


def main() -> None:
    # The protocol owns the original stdout; anything the planner prints goes to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
