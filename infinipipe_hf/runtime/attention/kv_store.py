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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVEntry:
    """K/V leaves ``[1, kv_heads, end - start, head_dim]`` of tokens [start, end) of one sequence."""

    start: int
    end: int
    k: torch.Tensor
    v: torch.Tensor

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


class KVStore:
    """K/V of earlier slices on one stage, keyed by (layer_idx, seq), ordered by slice start."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], dict[int, KVEntry]] = {}

    def put(self, layer_idx: int, seq: int, start: int, end: int, k: torch.Tensor,
            v: torch.Tensor) -> KVEntry:
        """Store the slice's own K/V as leaves; return the existing entry when already stored."""
        per_seq = self._entries.setdefault((layer_idx, seq), {})
        entry = per_seq.get(start)
        if entry is not None:
            assert entry.end == end and entry.k.shape == k.shape, (layer_idx, seq, start, end)
            return entry
        grad = torch.is_grad_enabled()
        entry = KVEntry(start, end, k.detach().requires_grad_(grad), v.detach().requires_grad_(grad))
        per_seq[start] = entry
        return entry

    def context(self, layer_idx: int, seq: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated K/V leaves of tokens [0, start) of ``seq`` at ``layer_idx``."""
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
        if len(pieces) == 1:
            return pieces[0].k, pieces[0].v
        return torch.cat([e.k for e in pieces], dim=2), torch.cat([e.v for e in pieces], dim=2)

    def free_sequence(self, seq: int) -> None:
        for key in [key for key in self._entries if key[1] == seq]:
            del self._entries[key]

    def sequences(self) -> set[int]:
        return {key[1] for key in self._entries}

    def clear(self) -> None:
        self._entries.clear()

    def bytes(self) -> int:
        """Bytes held by stored K/V and their accumulated gradients."""
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
        gk, gv = ctx.entry.pending_grads()
        return grad_out, gk, gv, None
