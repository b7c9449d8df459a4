"""Attention across slices: an HF ``AttentionInterface`` function driven by the unit's segments.

A stage sets ``config._attn_implementation = "epp"`` and calls each decoder layer with
``epp_unit=EPPUnitContext(...)``; transformers forwards unknown layer kwargs unchanged into the
attention function, so no global state is needed (and the recompute of a checkpointed layer sees
the same context because the checkpoint replays the same kwargs).  No mask function is
registered: transformers skips mask creation for implementations absent from
``AttentionMaskInterface``, and ours builds its masks from the segment table (``types.py``).

With sequence parallelism (``EPPUnitContext.sp``) the layer's Q/K/V cover only this rank's
token shard; an all-to-all turns them into all of the unit's tokens for this rank's heads, the
segment logic runs unchanged on that head-sharded problem (the KV store therefore holds this
rank's heads only; sharded over the ranks sharing a K/V head when there are such ranks,
``kv_shards.py``), and a second all-to-all returns the output to the rank's tokens.  Backends
never learn about SP: they get an ``AttentionSegments`` with fewer heads.
"""
from __future__ import annotations

import torch

from infinipipe_hf.runtime.attention.kv_store import PendingKVGrad
from infinipipe_hf.runtime.attention.types import AttentionSegments, EPPUnitContext

EPP_ATTENTION = "epp"


def _segment_keys(ctx: EPPUnitContext, layer: int, key: torch.Tensor, value: torch.Tensor):
    """Each segment's context + own K/V; stores the own K/V of segments that continue."""
    keys, values, context_lens, pending = [], [], [], []
    shard = ctx.sp.kv_group if ctx.sp is not None else None  # the K/V group sharding the store
    for i, seg in enumerate(ctx.segments):
        a, b = ctx.q_offsets[i], ctx.q_offsets[i + 1]
        k_own, v_own = key[:, :, a:b], value[:, :, a:b]
        if seg.start > 0:
            ck, cv = ctx.store.context(layer, seg.seq, seg.start, shard)
            keys.append(torch.cat([ck, k_own], dim=2))
            values.append(torch.cat([cv, v_own], dim=2))
        else:
            keys.append(k_own)
            values.append(v_own)
        context_lens.append(seg.start)
        if ctx.continues[i]:
            entry = ctx.store.put(layer, seg.seq, seg.start, seg.end, k_own, v_own, shard)
            pending.append((k_own, v_own, entry))
    return keys, values, context_lens, pending


def epp_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None,
                          dropout: float = 0.0, **kwargs):
    """``AttentionInterface`` function: (query [1,H,T,d], key/value [1,KV,T,d]) -> ([1,T,H,d], None)."""
    ctx: EPPUnitContext | None = kwargs.get("epp_unit")
    if ctx is None:
        raise RuntimeError("the 'epp' attention implementation runs only inside an infinipipe_hf stage "
                           "(it needs the unit's segment table via the `epp_unit` layer kwarg)")
    if attention_mask is not None:
        raise ValueError("the 'epp' attention builds its masks from the unit's segments; got an "
                         "attention_mask tensor, pass attention_mask=None")
    layer = module.layer_idx
    what = f"unit {ctx.unit_id}, layer {layer}"
    if ctx.sp is not None:
        query, key, value = ctx.sp.to_heads(query, key, value, what)
    assert query.shape[0] == 1 and query.shape[2] == ctx.q_offsets[-1], (query.shape, ctx.q_offsets)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    keys, values, context_lens, pending = _segment_keys(ctx, layer, key, value)
    idx = ctx.sp.expand_index(query.device) if ctx.sp is not None else None
    if idx is not None:
        # This rank's query heads do not group evenly onto its K/V heads: one K/V per query head.
        keys = [k.index_select(1, idx) for k in keys]
        values = [v.index_select(1, idx) for v in values]
    problem = AttentionSegments(query, keys, values, ctx.q_offsets, context_lens, scaling, dropout,
                                kwargs.get("sliding_window"))
    kept = ctx.kept_attention
    if kept is not None and (torch.is_grad_enabled() or kept.peeking_now):  # peeking: a no-grad rebuild
        out = kept.run(problem, layer)
    else:
        out = ctx.backend(problem)
    if torch.is_grad_enabled():
        for k_own, v_own, entry in pending:
            out = PendingKVGrad.apply(out, k_own, v_own, entry)
    if ctx.sp is not None:
        out = ctx.sp.to_sequence(out, what)
    return out, None


def register_epp_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(EPP_ATTENTION, epp_attention_forward)
