"""Per-stage store of the post-RoPE K/V of earlier slices, and of the gradients sent back to them.

Design: when a segment's sequence continues in a later slice, the attention function stores the
segment's own K and V as *detached leaves* (``requires_grad`` when training).  Later slices
concatenate the leaves of all earlier slices as their context, so their backward accumulates
dK/dV into the leaves' ``.grad`` with no extra bookkeeping.  The earlier slice collects those
gradients in its own backward through ``PendingKVGrad`` (identity on the attention output,
returning the leaves' accumulated grads as the gradients of its K and V).  Backward order (later
slices first) guarantees the grads are complete by then.

Entries are keyed by ``(layer_idx, seq)`` with one entry per slice start.  ``put`` is idempotent
per ``(layer, seq, start)``: the recompute of a checkpointed layer during backward reuses the
stored leaves (and their accumulated grads) instead of replacing them.  The trade-off of leaves
over recomputing context K/V is memory: K/V of in-flight sequences (and their grads) stay on the
stage until the sequence's first slice finished backward; ``bytes()`` reports it for accounting.

K/V offload (``offload = True``, set per step from the plan's ``offload_kv``): entries keep their
K/V in the store's ``HostTier`` instead (:class:`HostKVEntry`).  A later slice reading its context
gets the K/V back on the device (on CUDA the next layer's are prefetched meanwhile) through an
autograd function that adds their gradients to the entry's accumulators (on the host as well), so the
earlier slice's backward collects exactly what the device leaves would have held.  The store also
carries the stage's host tier for the ``offload`` checkpoint level (``recompute/layers.py``).

Sharded store (``shard``, a K/V group: SP ranks that received the same K/V head, see
``kv_shards.py``): an entry keeps only this rank's contiguous chunk of its tokens (``rows``), so
the ``r`` ranks sharing a head hold one copy between them instead of ``r``; a context read
gathers the chunks over the group (one all-to-all, whose backward returns each rank the gradient
of its chunk), and ``PendingKVGrad`` returns the chunk's gradient zero-padded to the slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from infinipipe_hf.runtime.attention.kv_shards import KVGroupExchange, chunk_rows, gather_context, widen
from infinipipe_hf.runtime.offload.host_tier import HostTensor, HostTier


@dataclass
class KVEntry:
    """K/V leaves ``[1, kv_heads, end - start, head_dim]`` of tokens [start, end) of one sequence."""

    start: int
    end: int
    k: torch.Tensor
    v: torch.Tensor
    rows: tuple[int, int] | None = None
    """Sharded over a K/V group: the rows ``[lo, hi)`` of the entry's tokens kept here (``k`` and
    ``v`` hold only those); ``None``: all of them."""

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def release(self) -> None:
        pass

    def pending_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        gk = self.k.grad if self.k.grad is not None else torch.zeros_like(self.k)
        gv = self.v.grad if self.v.grad is not None else torch.zeros_like(self.v)
        return gk, gv

    def bytes(self) -> int:
        n = 0
        for t in (self.k, self.v):
            n += t.numel() * t.element_size()
            if t.grad is not None:
                n += t.grad.numel() * t.grad.element_size()
        return n


@dataclass
class HostKVEntry:
    """K/V of tokens [start, end) of one sequence in the host tier, and the gradients later
    slices sent back to them (on the host too, brought back to add each new part)."""

    start: int
    end: int
    k: HostTensor
    v: HostTensor
    tier: HostTier
    requires_grad: bool
    gk: HostTensor | None = None
    gv: HostTensor | None = None
    rows: tuple[int, int] | None = None
    """As ``KVEntry.rows``: this rank's chunk of the entry's tokens when sharded."""

    anchor: torch.Tensor | None = None
    """An empty tensor that requires grad, so the K/V brought back join the graph (no leaf of
    theirs is kept by it: the device copies go as soon as the attention is done with them)."""

    def __post_init__(self) -> None:
        if self.requires_grad:
            self.anchor = torch.empty(0, requires_grad=True)

    def _back(self, h: HostTensor, which: str) -> torch.Tensor:
        if not self.requires_grad:
            return self.tier.get(h, keep=True)
        return _FromHost.apply(self.anchor, self, h, which)

    def _accumulate(self, which: str, g: torch.Tensor) -> None:
        have = getattr(self, which)
        total = g if have is None else self.tier.get(have) + g
        setattr(self, which, self.tier.put(total, self.k.tag))

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V back on the device; their gradients add to this entry's."""
        return self._back(self.k, "gk"), self._back(self.v, "gv")

    def prefetch(self) -> None:
        """Start bringing the K/V back (CUDA side stream), for the next layer's read."""
        self.tier.prefetch(self.k)
        self.tier.prefetch(self.v)

    def release(self) -> None:
        for h in (self.k, self.v, self.gk, self.gv):
            if h is not None:
                self.tier.release(h)

    def pending_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        def back(g: HostTensor | None, h: HostTensor) -> torch.Tensor:
            if g is None:
                return torch.zeros(h.host.shape, dtype=h.host.dtype, device=h.device)
            return self.tier.get(g)

        gk, gv = back(self.gk, self.k), back(self.gv, self.v)
        self.gk = self.gv = None
        return gk, gv

    def bytes(self) -> int:
        """Device bytes: none (K/V and their gradients wait on the host)."""
        return 0


class _FromHost(torch.autograd.Function):
    """A host K/V brought back to the device; its gradient goes to the entry's accumulator."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, entry: HostKVEntry, h: HostTensor, which: str):
        ctx.entry, ctx.which = entry, which
        return entry.tier.get(h, keep=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.entry._accumulate(ctx.which, grad)
        return None, None, None, None


class KVStore:
    """K/V of earlier slices on one stage, keyed by (layer_idx, seq), ordered by slice start."""

    def __init__(self, host_tier: HostTier | None = None) -> None:
        self._entries: dict[tuple[int, int], dict[int, KVEntry | HostKVEntry]] = {}
        self.host_tier = host_tier if host_tier is not None else HostTier()
        """The stage's host memory (K/V offload, the ``offload`` checkpoint level)."""
        self.offload = False
        """Keep new entries in ``host_tier`` (the plan's ``offload_kv`` names this stage)."""

    def put(self, layer_idx: int, seq: int, start: int, end: int, k: torch.Tensor,
            v: torch.Tensor, shard: KVGroupExchange | None = None) -> KVEntry | HostKVEntry:
        """Store the slice's own K/V as leaves (in the host tier when ``offload``); return the
        existing entry when already stored.  With ``shard`` (a K/V group), only this rank's
        chunk of the tokens (a copy of its own: the rest of ``k``'s storage is not kept)."""
        per_seq = self._entries.setdefault((layer_idx, seq), {})
        entry = per_seq.get(start)
        if entry is not None:
            assert entry.end == end, (layer_idx, seq, start, end)
            return entry
        rows = None
        if shard is not None:
            rows = chunk_rows(end - start, shard)
            k, v = k[:, :, rows[0]:rows[1]].detach().clone(), v[:, :, rows[0]:rows[1]].detach().clone()
        grad = torch.is_grad_enabled()
        if self.offload:
            tag = ("kv", seq)
            entry = HostKVEntry(start, end, self.host_tier.put(k, tag), self.host_tier.put(v, tag),
                                self.host_tier, grad, rows=rows)
        else:
            entry = KVEntry(start, end, k.detach().requires_grad_(grad), v.detach().requires_grad_(grad),
                            rows)
        per_seq[start] = entry
        return entry

    def context(self, layer_idx: int, seq: int, start: int,
                shard: KVGroupExchange | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated K/V leaves of tokens [0, start) of ``seq`` at ``layer_idx``; with ``shard``
        the entries hold this rank's chunks, gathered over the K/V group (one collective)."""
        per_seq = self._entries.get((layer_idx, seq), {})
        pieces, pos = [], 0
        for s in sorted(per_seq):
            if s >= start:
                break
            e = per_seq[s]
            if s != pos:
                break
            pieces.append(e)
            pos = e.end
        if pos != start:
            raise RuntimeError(
                f"KV store has tokens [0, {pos}) of sequence {seq} at layer {layer_idx} but a slice "
                f"starting at {start} needs [0, {start}): an earlier slice of the sequence did not run "
                f"forward on this stage first (check the plan's action order)")
        if any((e.rows is None) != (shard is None) for e in pieces):
            raise RuntimeError(f"sequence {seq} at layer {layer_idx}: a slice starting at {start} "
                               f"reads its context {'sharded' if shard else 'whole'}, but earlier "
                               f"slices stored it otherwise (units of one sequence on different SP groups)")
        kvs = [e.kv() for e in pieces]
        # The next layer's, ahead (CUDA): a replay in backward runs the layers last first.
        step = -1 if torch._C._current_graph_task_id() != -1 else 1
        for e in self._entries.get((layer_idx + step, seq), {}).values():
            if isinstance(e, HostKVEntry) and e.start < start:
                e.prefetch()
        if shard is not None:
            return gather_context(shard, [e.end - e.start for e in pieces], kvs,
                                  f"layer {layer_idx}, sequence {seq}, tokens [0, {start})")
        if len(kvs) == 1:
            return kvs[0]
        return torch.cat([k for k, _ in kvs], dim=2), torch.cat([v for _, v in kvs], dim=2)

    def free_sequence(self, seq: int) -> None:
        for key in [key for key in self._entries if key[1] == seq]:
            for e in self._entries.pop(key).values():
                e.release()

    def sequences(self) -> set[int]:
        return {key[1] for key in self._entries}

    def clear(self) -> None:
        """Drop every entry and every host-tier tensor of the step (the tier's resident bytes stay)."""
        self._entries.clear()
        self.host_tier.clear()

    def bytes(self) -> int:
        """Device bytes held by stored K/V and their accumulated gradients."""
        return sum(e.bytes() for per_seq in self._entries.values() for e in per_seq.values())

    def __len__(self) -> int:
        return sum(len(per_seq) for per_seq in self._entries.values())


class PendingKVGrad(torch.autograd.Function):
    """Identity on the attention output; hands the stored K/V leaves' grads to the slice's K/V."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, entry: KVEntry):
        ctx.entry = entry
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        entry = ctx.entry
        gk, gv = entry.pending_grads()
        if entry.rows is not None:  # this rank's chunk; the to-heads backward sums the K/V group's
            gk, gv = widen(gk, entry.rows, entry.end - entry.start), widen(gv, entry.rows, entry.end - entry.start)
        return grad_out, gk, gv, None
