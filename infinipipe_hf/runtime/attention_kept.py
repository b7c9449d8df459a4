"""The ``keep_attn`` checkpoint level: a whole layer recomputed in backward except its attention core.

A whole-layer checkpoint keeps only the layer's input and replays its forward in backward; on a
long slice most of that replay is the attention core (``softmax(q k^T) v`` over the slice and its
context).  The core's backward does not need the core's forward: a flash-style backward needs
q, k, v (rebuilt by the cheap part of the replay: norm, projections, rotary), the output and the
per-head log-sum-exp.  This level keeps those two beside the layer input (one hidden state and one
float per head per token more than ``full``) and replays everything but the core.

Design: :class:`KeptAttention` is a per-(unit, stage-call) store that rides in the unit context
(``EPPUnitContext.kept_attention``) of the layers the plan gives this level, so the checkpoint's
replay, which re-enters the layer with the same keyword arguments, finds it.  The attention
function hands the unit's attention problem to :func:`kept_attention`, an autograd function whose
first forward computes the output with its log-sum-exp and stores both, and whose replay (inside
the checkpoint's recompute, during backward) pops them instead of recomputing; either way it saves
q, k, v, output and log-sum-exp for its backward, so the checkpoint's saved-tensor bookkeeping sees
the same tensors in both runs.  The KV store's puts, the context reads and the SP all-to-alls
around the core replay as before (their outputs are q, k, v and the context keys, which the
backward needs).

Kernels: CPU has torch's flash attention for CPU, with a log-sum-exp output and a backward that
takes it (the same kernel ``F.scaled_dot_product_attention`` dispatches to, so outputs agree with
the ``sdpa`` backend bit for bit).  The CUDA kernels have the same pair (flash-attn's varlen
forward with ``return_attn_probs`` and its varlen backward), not wired yet: they cannot be tested
without a GPU, so the engine plans without this level off CPU (with a warning).  Dropout inside
attention is refused: a replay that skips the forward could not reproduce its mask.
"""
from __future__ import annotations

import torch

from .attention import AttentionSegments, segment_mask, square_causal

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def kept_attention_supported(device: torch.device | str, dropout: float = 0.0) -> str | None:
    """``None`` when the level can run here, else why not (for the engine's warning)."""
    device = torch.device(device)
    if device.type != "cpu":
        return (f"keep_attn needs an attention backward from a saved log-sum-exp, wired for CPU only "
                f"(the {device.type} kernels' is not)")
    if dropout:
        return f"keep_attn cannot replay attention dropout (attention_dropout={dropout})"
    return None


class KeptAttention:
    """Attention outputs and log-sum-exps of one unit's ``keep_attn`` layers on one stage, kept
    from the forward to the replay in backward (layer index -> (output, lse))."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def tensors(self) -> list[torch.Tensor]:
        """Everything held now (for memory accounting)."""
        return [t for pair in self._entries.values() for t in pair]

    def put(self, layer: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        self._entries[layer] = (out, lse)

    def pop(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._entries.pop(layer, None)


def _mask_of(query: torch.Tensor, context: int, sliding_window: int | None) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, additive mask or None) of a segment whose queries are ``query`` [1, H, L, d]."""
    length = query.shape[2]
    if square_causal(length, context, sliding_window):
        return True, None
    allowed = segment_mask(length, context, sliding_window, query.device)
    return False, torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, float("-inf"))


class _KeptAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, problem: AttentionSegments, store: KeptAttention, layer: int,
                query: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        n = len(kv) // 2
        kept = store.pop(layer)
        if kept is None:  # the first forward: compute, and keep for the replay
            outs, lses = [], []
            for i in range(n):
                q = query[:, :, problem.q_offsets[i]:problem.q_offsets[i + 1]]
                causal, mask = _mask_of(q, problem.context_lens[i], problem.sliding_window)
                o, lse = _FLASH_CPU(q, kv[i], kv[n + i], 0.0, causal, attn_mask=mask, scale=problem.scaling)
                outs.append(o)
                lses.append(lse)
            out = (outs[0] if n == 1 else torch.cat(outs, dim=2)).transpose(1, 2).contiguous()
            lse = lses[0] if n == 1 else torch.cat(lses, dim=2)
            store.put(layer, out.detach(), lse.detach())
        else:  # the checkpoint's replay in backward: the core's forward is skipped
            out, lse = kept
            out = out.detach()
        # Only the segment table is kept on ctx: the tensors go through save_for_backward, which
        # the checkpoint drops after the first forward and refills from the replay.
        ctx.q_offsets, ctx.context_lens = problem.q_offsets, problem.context_lens
        ctx.scaling, ctx.sliding_window = problem.scaling, problem.sliding_window
        ctx.save_for_backward(query, *kv, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        query, *rest = ctx.saved_tensors
        out, lse = rest[-2], rest[-1]
        n = (len(rest) - 2) // 2
        grad_heads = grad_out.transpose(1, 2)  # [1, H, T, d], as the kernel's output layout
        out_heads = out.transpose(1, 2)
        dqs, dks, dvs = [], [], []
        for i in range(n):
            sl = slice(ctx.q_offsets[i], ctx.q_offsets[i + 1])
            q = query[:, :, sl]
            causal, mask = _mask_of(q, ctx.context_lens[i], ctx.sliding_window)
            dq, dk, dv = _FLASH_CPU_BACKWARD(grad_heads[:, :, sl], q, rest[i], rest[n + i], out_heads[:, :, sl],
                                             lse[:, :, sl], 0.0, causal, attn_mask=mask, scale=ctx.scaling)
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        dq = dqs[0] if n == 1 else torch.cat(dqs, dim=2)
        return (None, None, None, dq, *dks, *dvs)


def kept_attention(a: AttentionSegments, store: KeptAttention, layer: int) -> torch.Tensor:
    """The unit's attention output ``[1, T, heads, d]`` (as a backend returns it) at ``keep_attn``."""
    why = kept_attention_supported(a.query.device, a.dropout)
    if why is not None:
        raise ValueError(f"layer {layer}: {why}; plan without it: checkpoint_levels=('mlp', 'mlp_act')")
    return _KeptAttentionFunction.apply(a, store, layer, a.query, *a.keys, *a.values)
