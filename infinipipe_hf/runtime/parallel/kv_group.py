"""The K/V groups of a stage's SP ranks: the consecutive ranks that receive the same K/V head.

When ``sp_degree`` is a larger multiple of the model's K/V heads, the Ulysses to-heads all-to-all
gives every rank exactly one K/V head and ``r = sp_degree // kv_heads`` consecutive ranks get the
same one (``sp_shards.head_shards``).  Those ``r`` ranks shard the carried K/V store between
them (``attention/kv_shards.py``) instead of each keeping a copy; :class:`KVGroup` is one rank's
place in its group (its *position*) and the all-to-all over it.  The process groups are built
with the layout's other groups (``ParallelLayout.kv_group``, one per K/V group of every stage,
created on every rank in one order).

The group runs two collectives, both on gloo and NCCL: an ``all_gather_into_tensor`` of equal
(padded) chunks for a context read and a ``reduce_scatter_tensor`` for its backward, so neither
direction holds a send or receive buffer of the whole context beside the context itself.
:func:`all_to_all` is the Ulysses all-to-alls' collective (a 1-D ``all_to_all_single`` with
explicit split sizes).  Every collective here is waited with the step's deadline on CPU, so that a
stuck peer is an error naming the ranks, never a hang.
"""
from __future__ import annotations

from typing import Any

import torch

from infinipipe_hf.runtime.parallel.comm import wait_collective


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *, group: Any,
               layout, ranks: list[int], timeout_s: float, step: int,
               what: str) -> tuple[torch.Tensor, Any]:
    """Send ``send`` (flat; ``send_splits[j]`` elements to the group's rank ``j``); return the
    flat concatenation, in rank order, of what each rank sent here, and the finished work."""
    import torch.distributed as dist

    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
    _wait(work, send, group=group, layout=layout, ranks=ranks, timeout_s=timeout_s, step=step, what=what)
    return recv, work


def _wait(work: Any, send: torch.Tensor, *, group: Any, layout, ranks: list[int], timeout_s: float,
          step: int, what: str) -> None:
    if send.device.type == "cuda":
        work.wait()  # stream order only: a host-side wait per layer would stall the GPU queue
    else:
        wait_collective(work, timeout_s=timeout_s, layout=layout, ranks=ranks, what=what, step=step,
                        group=group)


class KVGroup:
    """This rank's K/V group: ``size`` ranks sharing its K/V head, its ``position`` among them, and
    the group's two collectives."""

    def __init__(self, layout, clock) -> None:
        self.layout = layout
        self.size: int = layout.kv_group_size
        self.position: int = layout.sp_rank % self.size
        self.group = layout.kv_group
        self.ranks: list[int] = layout.kv_group_ranks()
        self._clock = clock  # the SP objects' deadline and step number
        self._finished: tuple = ()

    def all_gather(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's flat ``send`` (all of one size), concatenated in position order."""
        import torch.distributed as dist

        recv = send.new_empty(send.numel() * self.size)
        work = dist.all_gather_into_tensor(recv, send, group=self.group, async_op=True)
        return self._finish(work, send, recv, f"K/V group all-gather ({what})")

    def reduce_scatter(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """The sum over the group of every rank's ``position``-th of ``size`` equal parts of flat
        ``send``."""
        import torch.distributed as dist

        recv = send.new_empty(send.numel() // self.size)
        work = dist.reduce_scatter_tensor(recv, send, group=self.group, async_op=True)
        return self._finish(work, send, recv, f"K/V group reduce-scatter ({what})")

    def _finish(self, work: Any, send: torch.Tensor, recv: torch.Tensor, what: str) -> torch.Tensor:
        _wait(work, send, group=self.group, layout=self.layout, ranks=self.ranks,
              timeout_s=self._clock.timeout_s, step=self._clock.step, what=what)
        # As in SequenceParallel.exchange, gloo's buffers are freed on this thread, at the next
        # exchange; on CUDA the send buffer goes at once.
        self._finished = (work, send) if send.device.type != "cuda" else ()
        return recv
