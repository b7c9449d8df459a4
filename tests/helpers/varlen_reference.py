"""CPU stand-ins with the exact signatures of the fused varlen kernels, built on SDPA.

``sdpa_varlen_attn`` has the signature of torch's ``torch.nn.attention.varlen.varlen_attn``
(``window_size``, ``enable_gqa``), ``sdpa_varlen_attn_torch29`` the older one (``is_causal``, no
grouped heads), ``sdpa_flash_attn_varlen_func`` flash-attn's ``flash_attn_varlen_func``.  They
check what the real kernels require (``[T, heads, d]`` layouts, int32 ``cu_seqlens`` whose last
entry is the token count, ``max_seqlen`` equal to the longest segment, equal head counts unless
grouped heads are enabled) and compute lower-right aligned causal attention per segment with an
explicit mask, as the real kernels do, so the code around a kernel call runs on CPU exactly as it
does on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _segments(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, gqa):
    assert q.dim() == k.dim() == v.dim() == 3 and q.is_contiguous() and k.is_contiguous()
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == q.device
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert len(cq) == len(ck) and cq[0] == ck[0] == 0 and cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])), "max_q is not the longest query segment"
    assert max_k == max(b - a for a, b in zip(ck, ck[1:])), "max_k is not the longest key segment"
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads and not gqa:
        raise RuntimeError(f"number of key heads {kv_heads} != query heads {heads} (grouped heads off)")
    outs = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ks, vs = (t[ck[i]:ck[i + 1]].transpose(0, 1) for t in (k, v))
        if ks.shape[0] != heads:
            ks, vs = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (ks, vs))
        n, m = qs.shape[1], ks.shape[1]
        mask = None
        if causal:  # lower right: query j sees keys 0 .. (m - n) + j
            qpos = torch.arange(m - n, m, device=q.device).unsqueeze(1)
            kpos = torch.arange(m, device=q.device).unsqueeze(0)
            mask = kpos <= qpos
            if window_left >= 0:
                mask &= (qpos - kpos) <= window_left
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


def sdpa_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch >= 2.11 ``varlen_attn``: ``window_size=(-1, 0)`` is causal, (-1, -1) full attention."""
    left, right = window_size
    assert right in (-1, 0), "only full or causal windows are modelled"
    return _segments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, right == 0, left, enable_gqa)


def sdpa_varlen_attn_torch29(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                             return_aux=None, scale=None):
    """torch 2.9/2.10 ``varlen_attn``: ``is_causal``, no grouped K/V heads."""
    return _segments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal, -1, False)


def sdpa_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                block_table=None):
    """flash-attn 2 ``flash_attn_varlen_func``: grouped heads native, ``causal`` bottom-right."""
    assert dropout_p == 0.0
    return _segments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_size[0], True)


def upper_left_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                           window_size=(-1, -1), enable_gqa=False):
    """A kernel whose causal mask is aligned to the upper left (wrong for slices with context)."""
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    heads = query.shape[1]
    outs = []
    for i in range(len(cq) - 1):
        qs = query[cq[i]:cq[i + 1]].transpose(0, 1)
        ks, vs = (t[ck[i]:ck[i + 1]].transpose(0, 1).repeat_interleave(heads // key.shape[1], dim=0)
                  for t in (key, value))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)
