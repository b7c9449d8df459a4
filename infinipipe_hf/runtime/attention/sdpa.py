"""The always-available attention backend: torch SDPA, one call per segment with an explicit mask.

Simple and exact, at the price of a Python loop over segments and a dense boolean mask for each
segment with context or a narrow window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from infinipipe_hf.runtime.attention.types import AttentionSegments, segment_mask, square_causal

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


def sdpa_backend(a: AttentionSegments) -> torch.Tensor:
    heads = a.query.shape[1]
    outs = []
    # A segment without context attends to a view of the unit's K/V; beside a segment that
    # concatenates its context, autograd would keep the unit's whole K/V through that view (the
    # other segment's own K/V a second time), so such views are copied.
    copy_views = len(a.keys) > 1 and any(a.context_lens)
    for i, (k, v) in enumerate(zip(a.keys, a.values)):
        q = a.query[:, :, a.q_offsets[i]:a.q_offsets[i + 1]]
        if copy_views and not a.context_lens[i]:
            k, v = k.clone(), v.clone()
        groups = heads // k.shape[1]
        gqa = {}
        if groups > 1:
            if _SDPA_HAS_GQA:  # no repeated copies of K/V saved for backward (the memory model's view)
                gqa = {"enable_gqa": True}
            else:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
        length, context = q.shape[2], a.context_lens[i]
        if square_causal(length, context, a.sliding_window):
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=a.dropout, is_causal=True,
                                               scale=a.scaling, **gqa)
        else:
            mask = segment_mask(length, context, a.sliding_window, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=a.dropout,
                                               scale=a.scaling, **gqa)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)
