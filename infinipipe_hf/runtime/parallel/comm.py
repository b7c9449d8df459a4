"""Point-to-point transfer of hidden states and gradients between neighbouring stages, with timeouts.

Design: shapes and dtypes come from the plan on both sides (the plan is identical everywhere), so
only raw tensors cross the wire, never metadata.  Every transfer is non-blocking (``isend`` /
``irecv`` on the layout's two-rank link group of that direction, see ``mesh.py``); the caller
posts receives ahead and waits later,
which overlaps communication with compute.  Messages carry a tag that encodes (unit, direction):
hidden states of unit ``u`` use ``2u``, its gradient ``2u + 1``, so gloo matches each receive to
its send even when receives are posted ahead in a different order than the peer's sends.

Every wait has a deadline (``p2p_timeout_s``).  On timeout or a lost connection the wait raises
``RuntimeError`` naming this rank, the peer, the step and the action: a dead or stuck rank ends the
job with a readable error instead of a hang.  The message names the setting the user controls the
deadline with (``layout.timeout_setting``: ``InfiniPipeConfig.p2p_timeout_s`` for the engine,
``ddp_timeout`` under the trainer), not a hard-coded name.  Trade-off: gloo closes the connection pair after a
timed-out wait, so a timeout is fatal for the process group; that is intended (a pipeline with a
missing stage cannot continue), and recovery is left to the launcher (restart from checkpoint).
Collectives go through ``wait_collective`` with the same deadline.  A stopped peer ends a wait
long before the deadline: every wait is registered with the peer watch (``peer_watch.py``), which
releases it once the peer's heartbeat stood still, and the error then says so.

On CUDA the transfers are posted from a stream of their own (``P2PStream``): a send's cast and copy
and a receive's buffer wait only for the compute that produced the data (an event at posting),
never for compute queued after it, and the compute stream waits for a received buffer only when
it is used (``wait``).  On CPU (gloo) there is no stream and nothing changes.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
from infinipipe_hf.runtime.parallel.peer_watch import Wait, verdict_of, watching

HIDDEN = 0
GRAD = 1
_WHAT = {HIDDEN: "hidden states", GRAD: "gradients"}


def message_tag(unit_id: int, kind: int) -> int:
    return 2 * unit_id + kind


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


@dataclass
class Transfer:
    """One posted send or receive; ``tensor`` is the buffer (the received data after ``wait``)."""

    work: Any
    tensor: torch.Tensor
    peer: int
    kind: int
    unit_id: int
    is_recv: bool
    posted_at: float
    group: Any = None
    """Process group the transfer was posted on (``None``: the default group)."""


class StageComm:
    """Non-blocking transfers between this rank and its neighbours in the same replica."""

    def __init__(self, layout: ParallelLayout, *, timeout_s: float, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.layout = layout
        self.timeout_s = float(timeout_s)
        self.device = device
        self.dtype = dtype
        self.wait_time_s = 0.0
        """Seconds spent blocked in ``wait`` since the last ``reset_wait_time``."""
        self.streams = P2PStream(device)

    # --- posting -------------------------------------------------------------------------
    def post_recv(self, shape: tuple[int, ...], kind: int, unit_id: int) -> Transfer:
        import torch.distributed as dist

        peer = self.layout.prev_rank if kind == HIDDEN else self.layout.next_rank
        assert peer is not None, f"{self.layout.describe()} has no peer for {_WHAT[kind]}"
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        group = self.layout.link_group(peer, self.layout.rank)
        with self.streams.posting(buf):
            work = dist.irecv(buf, src=peer, group=group, tag=message_tag(unit_id, kind))
        return Transfer(work, buf, peer, kind, unit_id, True, time.perf_counter(), group)

    def post_send(self, tensor: torch.Tensor, kind: int, unit_id: int) -> Transfer:
        import torch.distributed as dist

        peer = self.layout.next_rank if kind == HIDDEN else self.layout.prev_rank
        assert peer is not None, f"{self.layout.describe()} has no peer for {_WHAT[kind]}"
        group = self.layout.link_group(self.layout.rank, peer)
        with self.streams.posting(tensor):
            tensor = tensor.detach().to(self.dtype).contiguous()
            work = dist.isend(tensor, dst=peer, group=group, tag=message_tag(unit_id, kind))
        return Transfer(work, tensor, peer, kind, unit_id, False, time.perf_counter(), group)

    # --- waiting -------------------------------------------------------------------------
    def wait(self, transfer: Transfer, *, step: int, action: str) -> torch.Tensor:
        """Block until ``transfer`` completes or its deadline passes; return its tensor."""
        t0 = time.perf_counter()
        # The deadline counts from posting: a receive posted ahead has been waiting all along.
        remaining = max(self.timeout_s - (t0 - transfer.posted_at), 0.001)
        watch = None
        try:
            with watching([transfer.peer], transfer.group, self.layout.describe) as watch:
                if self.device.type == "cuda":
                    # NCCL's wait() only orders streams (its timeout is enforced by a watchdog
                    # that aborts the process without naming the action): poll completion here.
                    poll_completion(transfer.work, t0 + remaining, watch)
                transfer.work.wait(timeout=timedelta(seconds=remaining))
        except Exception as exc:  # gloo raises RuntimeError; keep its text for diagnosis
            raise RuntimeError(self._failure_message(transfer, step, action, exc, watch)) from exc
        finally:
            self.wait_time_s += time.perf_counter() - t0
        return transfer.tensor

    def _failure_message(self, t: Transfer, step: int, action: str, exc: BaseException,
                         watch: Wait | None = None) -> str:
        me = self.layout.describe()
        peer = self.layout.describe(t.peer)
        what = _WHAT[t.kind]
        where = f"{me}: step {step}, action {action}"
        verdict = verdict_of(watch)
        if verdict:
            if t.is_recv:
                return f"{where}: waiting for the {what} of unit {t.unit_id} from {peer}: {verdict}"
            return f"{where}: waiting for {peer} to take the {what} of unit {t.unit_id}: {verdict}"
        return with_culprit(self.layout, self._lost_peer_message(t, where, peer, what, exc))

    def _lost_peer_message(self, t: Transfer, where: str, peer: str, what: str, exc: BaseException) -> str:
        if _is_timeout(exc):
            if t.is_recv:
                return (f"{where}: no {what} of unit {t.unit_id} from {peer} within "
                        f"{self.timeout_s:g} s; that rank has died or is stuck "
                        f"(raise {self.layout.timeout_setting} if it is only slow)")
            return (f"{where}: {peer} did not take the {what} of unit {t.unit_id} within "
                    f"{self.timeout_s:g} s; that rank has died or is stuck "
                    f"(raise {self.layout.timeout_setting} if it is only slow)")
        direction = "from" if t.is_recv else "to"
        return (f"{where}: lost the connection to {peer} while transferring {what} of unit "
                f"{t.unit_id} {direction} it; that rank has died or stopped on an error of its own "
                f"({type(exc).__name__}: {exc})")


class P2PStream:
    """The stream point-to-point transfers are posted from on CUDA; a no-op elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    @contextmanager
    def posting(self, tensor: torch.Tensor):
        """Run the body (cast, ``isend`` / ``irecv``) on the p2p stream, after the compute queued
        so far; ``tensor`` (made on the compute stream) stays allocated until the stream used it.
        The compute stream orders itself after a receive in ``Work.wait`` (``StageComm.wait``)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield


def poll_completion(work: Any, deadline: float, watch: Wait | None) -> None:
    """Return once ``work`` completed; ``RuntimeError`` past ``deadline`` (``perf_counter``) or
    once the peer watch has a verdict."""
    while not work.is_completed():
        if watch is not None and watch.verdict:
            raise RuntimeError("a peer has stopped")
        if time.perf_counter() > deadline:
            raise RuntimeError("timed out")
        time.sleep(1e-4)


def wait_collective(work: Any, *, timeout_s: float, layout: ParallelLayout, ranks: list[int],
                    what: str, step: int, group: Any = None) -> None:
    """Wait for an async collective over ``group`` (``None``: the default group) with a deadline;
    on failure name the ranks involved (and the rank that failed first, when it is known)."""
    t0 = time.perf_counter()
    watch = None
    try:
        with watching(ranks, group, layout.describe) as watch:
            if layout.device_type == "cuda":  # as in StageComm.wait: NCCL's wait only orders streams
                poll_completion(work, t0 + timeout_s, watch)
            work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        verdict = verdict_of(watch)
        if verdict:
            raise RuntimeError(f"{layout.describe()}: step {step}, {what} over ranks {ranks}: "
                               f"{verdict}") from exc
        raise RuntimeError(with_culprit(layout, collective_failure(
            layout, what, ranks, step, timeout_s, time.perf_counter() - t0, exc))) from exc


def collective_failure(layout: ParallelLayout, what: str, ranks: list[int], step: int,
                       timeout_s: float, waited_s: float, exc: BaseException) -> str:
    """A timeout is reported as one; a connection lost before the deadline is not."""
    where = f"{layout.describe()}: step {step}, {what} over ranks {ranks}"
    if _is_timeout(exc) or waited_s >= timeout_s:
        return (f"{where} did not complete within {timeout_s:g} s; one of those ranks has died or is "
                f"stuck (raise {layout.timeout_setting} if it is only slow) ({type(exc).__name__}: {exc})")
    return (f"{where} failed after {waited_s:.1f} s: a rank of the group left (it died or stopped on "
            f"an error of its own) ({type(exc).__name__}: {exc})")


def with_culprit(layout: ParallelLayout, message: str) -> str:
    """``message`` followed by the rank that failed first and its error, or the ranks whose
    heartbeat stopped, when the status exchange knows (``failures.py``)."""
    from infinipipe_hf.runtime.parallel.failures import explain

    why = explain(list(range(layout.world_size)), layout.describe)
    return f"{message}; {why}" if why else message
