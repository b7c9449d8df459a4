"""The carried K/V store sharded over the SP ranks that share a K/V head (a *K/V group*).

When ``sp_degree`` is a larger multiple of the K/V heads, ``r`` consecutive SP ranks receive the
same K/V head over all of a unit's tokens (``runtime/parallel/kv_group.py``); a replicated store
would keep ``r`` copies of every carried K/V and of its gradients.  Sharded, a rank keeps of each
entry (tokens ``[start, end)``) only its *chunk*: the contiguous rows ``token_shards(end - start,
r).range(position)`` (the first ranks take the remainder, a rank may have none).

Reading the context (``gather_context``): the rank's chunks of the earlier entries, in order,
go to every peer of the K/V group in one ``all_to_all`` per (layer, read), K and V together;
each rank reassembles the full context ``[1, 1, start, d]`` in token order (identical on every
rank of the group).  Its backward sends each peer the rows of the incoming gradient that fall in
that peer's chunks and sums what it receives: the gradient of this rank's chunks from every
rank's query heads, which autograd adds to the chunk leaves (or the host accumulators).

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

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                   what: str) -> torch.Tensor:
        """Send ``send_splits[j]`` elements of flat ``send`` to peer ``j``; return what came, in
        peer order (``recv_splits`` elements each)."""


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


def _split_rows(block: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``block`` ``[1, h, sum(sizes), d]`` cut along the rows into pieces of ``sizes``."""
    return list(torch.split(block, sizes, dim=2))


class _GatherKV(torch.autograd.Function):
    """Chunks of the entries on each rank -> the full context on every rank; backward: each
    rank's chunk rows of every rank's gradient, summed."""

    @staticmethod
    def forward(ctx, group: KVGroupExchange, lengths: tuple[int, ...], what: str, *chunks: torch.Tensor):
        n, r = len(lengths), group.size
        sizes = _chunk_sizes(lengths, r)
        ref = chunks[0]
        heads, d = ref.shape[1], ref.shape[-1]
        mine = torch.cat(chunks, dim=2)  # this rank's K chunks, then its V chunks
        rows = [sum(s[q] for s in sizes) for q in range(r)]  # chunk rows of each peer
        send = mine.reshape(-1).repeat(r)  # the same to every peer
        recv = group.all_to_all(send, [mine.numel()] * r, [heads * 2 * m * d for m in rows],
                                f"{what}, K/V context")
        pieces_k: list[list[torch.Tensor]] = [[] for _ in range(n)]
        pieces_v: list[list[torch.Tensor]] = [[] for _ in range(n)]
        offset = 0
        for q in range(r):
            block = recv[offset:offset + heads * 2 * rows[q] * d].view(1, heads, 2 * rows[q], d)
            offset += heads * 2 * rows[q] * d
            parts = _split_rows(block, [s[q] for s in sizes] * 2)
            for e in range(n):
                pieces_k[e].append(parts[e])
                pieces_v[e].append(parts[n + e])
        ctx.group, ctx.sizes, ctx.what = group, sizes, what
        ck = torch.cat([p for per in pieces_k for p in per], dim=2)
        cv = torch.cat([p for per in pieces_v for p in per], dim=2)
        return ck, cv

    @staticmethod
    def backward(ctx, gk: torch.Tensor, gv: torch.Tensor):
        group, sizes = ctx.group, ctx.sizes
        n, r, me = len(sizes), group.size, group.position
        ref = gk if gk is not None else gv
        heads, d = ref.shape[1], ref.shape[-1]
        gk = gk if gk is not None else torch.zeros_like(gv)
        gv = gv if gv is not None else torch.zeros_like(gk)
        # The context's rows entry by entry, peer by peer: piece (e, q) is peer q's chunk of entry e.
        flat_sizes = [s[q] for s in sizes for q in range(r)]
        parts_k, parts_v = _split_rows(gk, flat_sizes), _split_rows(gv, flat_sizes)
        per_peer = [[parts_k[e * r + q] for e in range(n)] + [parts_v[e * r + q] for e in range(n)]
                    for q in range(r)]
        send = torch.cat([torch.cat(p, dim=2).reshape(-1) for p in per_peer])
        rows = [sum(s[q] for s in sizes) for q in range(r)]
        mine = rows[me]
        recv = group.all_to_all(send, [heads * 2 * m * d for m in rows], [heads * 2 * mine * d] * r,
                                f"{ctx.what}, K/V context gradients")
        total = recv.view(r, heads, 2 * mine, d).sum(0).unsqueeze(0)
        # One storage per chunk gradient (a view would keep the whole sum alive in a leaf's .grad).
        grads = [g.clone() for g in _split_rows(total, [s[me] for s in sizes] * 2)]
        return (None, None, None, *grads)
