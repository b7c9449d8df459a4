"""The ``keep_attn`` and ``offload_attn`` levels: a whole layer recomputed in backward but its attention core.

A whole-layer checkpoint keeps only the layer's input and replays its forward in backward; on a
long slice most of that replay is the attention core (``softmax(q k^T) v`` over the slice and its
context).  The core's backward does not need the core's forward: a flash-style backward needs
q, k, v (rebuilt by the cheap part of the replay: norm, projections, rotary), the output and the
per-head log-sum-exp.  This level keeps those two beside the layer input (one hidden state and one
float per head per token more than ``full``) and replays everything but the core.

Design: :class:`KeptAttention` is a per-(unit, stage-call) store that rides in the unit context
(``EPPUnitContext.kept_attention``) of the layers the plan gives this level, so the checkpoint's
replay, which re-enters the layer with the same keyword arguments, finds it.  The attention
function hands the unit's attention problem to :meth:`KeptAttention.run`, an autograd function whose
first forward computes the output with its log-sum-exp and stores both, and whose replay (inside
the checkpoint's recompute, during backward) pops them instead of recomputing; either way it saves
q, k, v, output and log-sum-exp for its backward, so the checkpoint's saved-tensor bookkeeping sees
the same tensors in both runs.  The KV store's puts, the context reads and the SP all-to-alls
around the core replay unchanged (their outputs are q, k, v and the context keys, which the
backward needs).

The ``offload_attn`` level is this one with everything it keeps in the stage's host tier: its
store (``KeptAttention(host_tier, tag)``) copies the output, log-sum-exp and aux tensors out with
``HostTier.put`` as the first forward keeps them (they are kept, not autograd-saved, so the
saved-tensor hooks that move the layer input, ``offload/activation_hooks.py``, never see them) and
brings them back with ``get`` when the replay pops them; the replay's own ``save_for_backward``
runs in backward, outside those hooks, so it saves device tensors as ``keep_attn``'s does.
The ``offload_pair`` level (``offload_pair.py``) replays a pair's first layer without grad to
rebuild the second one's input: inside :meth:`KeptAttention.peeking` the core returns the kept
output with no graph and leaves the entry for the layer's own replay.

Kernels (``attention/kept_kernels.py``): torch's flash attention for CPU, per segment, and torch's
flash-attention varlen pair on CUDA (float16/bfloat16, checked on the device before the level is
planned there).  Dropout inside attention is refused: a replay that skips the forward could not
reproduce its mask.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from infinipipe_hf.runtime.attention import kept_kernels as kernels
from infinipipe_hf.runtime.attention.types import AttentionSegments
from infinipipe_hf.runtime.offload.host_tier import HostTensor, HostTier


def kept_attention_supported(device: torch.device | str, dtype: torch.dtype, dropout: float = 0.0,
                             head_dim: int | None = None) -> str | None:
    """``None`` when the level can run here, else why not (for the engine's warning)."""
    if dropout:
        return f"keep_attn cannot replay attention dropout (attention_dropout={dropout})"
    kernel = kernels.kernel_for(device, dtype, head_dim)
    return kernel if isinstance(kernel, str) else None


class KeptAttention:
    """Attention outputs and log-sum-exps of one unit's ``keep_attn`` layers on one stage, kept
    from the forward to the replay in backward (layer index -> (output, lse, the kernel's aux)).
    With ``host_tier`` (the ``offload_attn`` level) they wait there, tagged ``tag``, instead of on
    the device."""

    def __init__(self, host_tier: HostTier | None = None, tag: object = None) -> None:
        self._entries: dict[int, tuple] = {}
        self.host_tier, self.tag = host_tier, tag
        self.peeking_now = False
        """Inside :meth:`peeking`: ``run`` reads the kept output and keeps the entry."""

    def __len__(self) -> int:
        return len(self._entries)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors held now (for memory accounting): none when kept in the host tier."""
        if self.host_tier is not None:
            return []
        return [t for out, lse, aux in self._entries.values() for t in (out, lse, *aux)]

    def put(self, layer: int, out: torch.Tensor, lse: torch.Tensor, aux: tuple[torch.Tensor, ...] = ()) -> None:
        tier = self.host_tier
        if tier is None:
            self._entries[layer] = (out, lse, tuple(aux))
            return
        # Tensors off the device (the CUDA pair's CPU random-number state) or empty stay as they are.
        device = out.device
        held = [tier.put(t, self.tag) if t.numel() and t.device == device else t for t in (out, lse, *aux)]
        self._entries[layer] = (held[0], held[1], tuple(held[2:]))

    def pop(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]] | None:
        entry = self._entries.pop(layer, None)
        tier = self.host_tier
        if entry is None or tier is None:
            return entry
        out, lse, aux = entry
        held = (out, lse, *aux)
        for h in held:  # CUDA: all three copies in flight at once
            if isinstance(h, HostTensor):
                tier.prefetch(h)
        out, lse, *aux = (tier.get(h) if isinstance(h, HostTensor) else h for h in held)
        tier.prefetch_tag(self.tag)  # the next thing the backward reads
        return out, lse, tuple(aux)

    def peek(self, layer: int) -> torch.Tensor | None:
        """``layer``'s kept attention output on the device, the entry left in place (its host copy
        read with ``keep=True``): what an ``offload_pair`` rebuild's no-grad replay needs, before
        the layer's own replay pops it (not the log-sum-exp: only the core's backward reads it)."""
        entry = self._entries.get(layer)
        if entry is None:
            return None
        out = entry[0]
        return self.host_tier.get(out, keep=True) if isinstance(out, HostTensor) else out

    @contextmanager
    def peeking(self) -> Iterator[None]:
        """Inside: the attention core returns the kept output of its layer without consuming the
        entry, under ``no_grad`` too (the ``offload_pair`` rebuild replays a layer whose own
        replay comes later)."""
        self.peeking_now = True
        try:
            yield
        finally:
            self.peeking_now = False

    def __del__(self) -> None:  # a graph freed without its backward (an aborted step)
        try:
            if self.host_tier is not None:
                for out, lse, aux in self._entries.values():
                    for h in (out, lse, *aux):
                        if isinstance(h, HostTensor):
                            self.host_tier.release(h)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def run(self, problem: AttentionSegments, layer: int) -> torch.Tensor:
        """The attention core of ``layer`` at ``keep_attn`` (what the attention function calls);
        while :meth:`peeking`, the kept output itself (no graph: the rebuild runs without grad)."""
        if self.peeking_now:
            out = self.peek(layer)
            if out is None:
                raise RuntimeError(f"layer {layer}: an offload_pair rebuild replays this layer but its kept "
                                   f"attention output is gone (its own replay ran first?)")
            return out
        return kept_attention(problem, self, layer)


class _KeptAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, problem: AttentionSegments, store: KeptAttention, layer: int, kernel: "kernels.KeptKernel",
                query: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        kept = store.pop(layer)
        if kept is None:  # the first forward: compute, and keep for the replay
            out, lse, aux = kernel.forward(problem)
            out, lse, aux = out.detach(), lse.detach(), tuple(t.detach() for t in aux)
            store.put(layer, out, lse, aux)
        else:  # the checkpoint's replay in backward: the core's forward is skipped
            out, lse, aux = kept
        # Only the segment table is kept on ctx: the tensors go through save_for_backward, which
        # the checkpoint drops after the first forward and refills from the replay.
        ctx.layout = (problem.q_offsets, problem.context_lens, problem.scaling, problem.sliding_window)
        ctx.kernel, ctx.num_segments, ctx.num_aux = kernel, len(kv) // 2, len(aux)
        ctx.save_for_backward(query, *kv, out, lse, *aux)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = ctx.saved_tensors
        n, query = ctx.num_segments, saved[0]
        keys, values = list(saved[1:1 + n]), list(saved[1 + n:1 + 2 * n])
        out, lse, aux = saved[1 + 2 * n], saved[2 + 2 * n], saved[3 + 2 * n:]
        assert len(aux) == ctx.num_aux
        q_offsets, context_lens, scaling, sliding_window = ctx.layout
        problem = AttentionSegments(query, keys, values, q_offsets, context_lens, scaling, 0.0, sliding_window)
        dq, dks, dvs = ctx.kernel.backward(problem, grad_out, out, lse, aux)
        return (None, None, None, None, dq, *dks, *dvs)


def kept_attention(a: AttentionSegments, store: KeptAttention, layer: int) -> torch.Tensor:
    """The unit's attention output ``[1, T, heads, d]`` (as a backend returns it) at ``keep_attn``."""
    level = "keep_attn" if store.host_tier is None else "offload_attn (keep_attn in host memory)"
    if a.dropout:
        raise ValueError(f"layer {layer}: {level} cannot replay attention dropout ({a.dropout}); plan "
                         f"without it: checkpoint_levels=('mlp', 'mlp_act')")
    kernel = kernels.kernel_for(a.query.device, a.query.dtype, a.query.shape[-1])
    if isinstance(kernel, str):
        raise ValueError(f"layer {layer} at {level}: {kernel}; plan without it: "
                         f"checkpoint_levels=('mlp', 'mlp_act')")
    return _KeptAttentionFunction.apply(a, store, layer, kernel, a.query, *a.keys, *a.values)
