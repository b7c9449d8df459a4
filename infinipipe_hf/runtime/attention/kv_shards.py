"""The carried K/V store sharded over the SP ranks that share a K/V head (a *K/V group*).

When ``sp_degree`` is a larger multiple of the K/V heads, ``r`` consecutive SP ranks receive the
same K/V head over all of a unit's tokens (``runtime/parallel/kv_group.py``); a replicated store
would keep ``r`` copies of every carried K/V and of its gradients.  Sharded, a rank keeps of each
entry (tokens ``[start, end)``) only its *chunk*: the contiguous rows ``token_shards(end - start,
r).range(position)`` (the first ranks take the remainder, a rank may have none).

Reading the context (``gather_context``): the rank's chunks of the earlier entries, K and V
together in one buffer padded to the longest peer's rows, go to every peer of the K/V group in
one ``all_gather`` per (layer, read); each rank reassembles the full context ``[1, 1, start, d]``
in token order (identical on every rank of the group).  Its backward lays the incoming gradient
out the same way, peer by peer, and one ``reduce_scatter`` leaves each rank the sum over the group
of its own chunks' rows: the gradient of this rank's chunks from every rank's query heads, which
autograd adds to the chunk leaves (or the host accumulators).  Beside the context (forward) or
its gradient (backward), a read holds one context-sized buffer and at most two ``1 / r`` of it.

The earlier slice's backward (``PendingKVGrad``) then hands its K/V a full-size gradient that is
zero outside the rank's chunk (``widen``); the to-heads all-to-all's backward sums it over the
K/V group, so the slice gets the total gradient, as from a replicated store.  A checkpointed
layer's recompute reads the context again: the same collective, on every rank of the group, in
the same order (every rank of a stage runs the same actions).
"""
from __future__ import annotations

from typing import Protocol

import torch

from infinipipe_hf.runtime.parallel.sp_shards import token_shards


class KVGroupExchange(Protocol):
    """This rank's K/V group (``runtime.parallel.kv_group.KVGroup``)."""

    size: int
    position: int

    def all_gather(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """Every peer's flat ``send`` (all of one size), concatenated in peer order."""

    def reduce_scatter(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """The sum over the peers of each one's ``position``-th of ``size`` equal parts of ``send``."""


def chunk_rows(num_tokens: int, group: KVGroupExchange) -> tuple[int, int]:
    """``[lo, hi)`` of an entry's ``num_tokens`` rows that this rank keeps."""
    return token_shards(num_tokens, group.size).range(group.position)


def widen(g: torch.Tensor, rows: tuple[int, int], num_tokens: int) -> torch.Tensor:
    """A chunk's gradient as a gradient of the entry's ``num_tokens`` rows: zero outside the chunk."""
    shape = list(g.shape)
    shape[2] = num_tokens
    full = g.new_zeros(shape)
    full[:, :, rows[0]:rows[1]] = g
    return full


def gather_context(group: KVGroupExchange, lengths: list[int], kvs: list[tuple[torch.Tensor, torch.Tensor]],
                   what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The context K/V ``[1, kv, sum(lengths), d]`` from this rank's chunks ``kvs`` of entries of
    ``lengths`` tokens (in token order), gathered over the K/V group; differentiable."""
    ck, cv = _GatherKV.apply(group, tuple(lengths), what, *[k for k, _ in kvs], *[v for _, v in kvs])
    return ck, cv


def _chunk_sizes(lengths: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    """Per entry, the rows of each peer's chunk."""
    return [token_shards(n, size).sizes for n in lengths]


def _offsets(sizes: list[tuple[int, ...]], r: int) -> list[list[int]]:
    """Per entry and peer, the row where the peer's chunk of the entry starts in its buffer (the
    peer's chunks of the entries in order: K rows first, V rows ``width`` further)."""
    offs, run = [], [0] * r
    for s in sizes:
        offs.append(list(run))
        run = [a + b for a, b in zip(run, s)]
    return offs


class _GatherKV(torch.autograd.Function):
    """Chunks of the entries on each rank -> the full context on every rank (all-gather of padded
    per-peer buffers); backward: each rank's chunk rows of every rank's gradient, summed
    (reduce-scatter of the gradient laid out the same way)."""

    @staticmethod
    def forward(ctx, group: KVGroupExchange, lengths: tuple[int, ...], what: str, *chunks: torch.Tensor):
        n, r, me = len(lengths), group.size, group.position
        sizes = _chunk_sizes(lengths, r)
        offs = _offsets(sizes, r)
        width = max(sum(s[q] for s in sizes) for q in range(r))  # rows of the longest peer
        heads, d = chunks[0].shape[1], chunks[0].shape[-1]
        mine = chunks[0].new_zeros(heads, 2 * width, d)
        for e in range(n):
            lo, m = offs[e][me], sizes[e][me]
            mine[:, lo:lo + m] = chunks[e][0]
            mine[:, width + lo:width + lo + m] = chunks[n + e][0]
        blocks = group.all_gather(mine.reshape(-1), f"{what}, K/V context").view(r, heads, 2 * width, d)
        del mine
        ck = torch.cat([blocks[q:q + 1, :, offs[e][q]:offs[e][q] + sizes[e][q]]
                        for e in range(n) for q in range(r)], dim=2)
        cv = torch.cat([blocks[q:q + 1, :, width + offs[e][q]:width + offs[e][q] + sizes[e][q]]
                        for e in range(n) for q in range(r)], dim=2)
        ctx.group, ctx.sizes, ctx.offs, ctx.width, ctx.what = group, sizes, offs, width, what
        return ck, cv

    @staticmethod
    def backward(ctx, gk: torch.Tensor, gv: torch.Tensor):
        group, sizes, offs, width = ctx.group, ctx.sizes, ctx.offs, ctx.width
        n, r, me = len(sizes), group.size, group.position
        ref = gk if gk is not None else gv
        heads, d = ref.shape[1], ref.shape[-1]
        send = ref.new_zeros(r, heads, 2 * width, d)  # peer q's part: the rows of its chunks
        row = 0
        for e in range(n):
            for q in range(r):
                lo, m = offs[e][q], sizes[e][q]
                if gk is not None:
                    send[q, :, lo:lo + m] = gk[0, :, row:row + m]
                if gv is not None:
                    send[q, :, width + lo:width + lo + m] = gv[0, :, row:row + m]
                row += m
        del gk, gv
        total = group.reduce_scatter(send.reshape(-1), f"{ctx.what}, K/V context gradients")
        total = total.view(1, heads, 2 * width, d)
        del send
        # One storage per chunk gradient (a view would keep the whole sum alive in a leaf's .grad).
        spans = [(offs[e][me], sizes[e][me]) for e in range(n)]
        grads = [total[:, :, lo:lo + m].clone() for lo, m in spans]
        grads += [total[:, :, width + lo:width + lo + m].clone() for lo, m in spans]
        return (None, None, None, *grads)
