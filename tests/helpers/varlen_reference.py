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


def _cu_offsets(q, k, cu_q, cu_k, max_q, max_k) -> tuple[list[int], list[int]]:
    """The host offsets of ``cu_q``/``cu_k``, after the checks the real kernels make on them."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == q.device
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert len(cq) == len(ck) and cq[0] == ck[0] == 0 and cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])), "max_q is not the longest query segment"
    assert max_k == max(b - a for a, b in zip(ck, ck[1:])), "max_k is not the longest key segment"
    return cq, ck


def _segments(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, gqa):
    assert q.dim() == k.dim() == v.dim() == 3 and q.is_contiguous() and k.is_contiguous()
    cq, ck = _cu_offsets(q, k, cu_q, cu_k, max_q, max_k)
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


# --- the flash-attention pair keep_attn runs on CUDA (aten signatures) ------------------------
def _flash_pair_segments(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, window_left, upper_left=False):
    """Per segment: (query rows, key rows, boolean mask [queries, keys], the same for every head)."""
    assert q.dim() == k.dim() == v.dim() == 3 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    cq, ck = _cu_offsets(q, k, cu_q, cu_k, max_q, max_k)
    assert q.shape[1] % k.shape[1] == 0, "query heads must be a multiple of key heads"
    for i in range(len(cq) - 1):
        n, m = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        shift = 0 if upper_left else m - n  # flash: causal aligned to the lower right
        qpos = torch.arange(shift, shift + n).unsqueeze(1)
        kpos = torch.arange(m).unsqueeze(0)
        mask = torch.ones(n, m, dtype=torch.bool)
        if is_causal:
            mask &= kpos <= qpos
        if window_left is not None and window_left >= 0:
            mask &= (qpos - kpos) <= window_left
        yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), mask


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def sdpa_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None,
                                 upper_left=False):
    """``aten::_flash_attention_forward`` on the varlen path, written out from the softmax: returns
    (output [Tq, H, d], logsumexp [H, Tq], rng_state, unused, debug mask)."""
    assert dropout_p == 0.0 and not return_debug_mask
    assert window_size_right in (None, 0, -1)
    heads, group = query.shape[1], query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    lse = torch.empty(heads, query.shape[0], dtype=_lse_dtype(query))
    for qs, ks, mask in _flash_pair_segments(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                             window_size_left, upper_left):
        q = query[qs].transpose(0, 1)  # [H, n, d]
        k, v = (t[ks].transpose(0, 1).repeat_interleave(group, dim=0) for t in (key, value))
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        seg_lse = torch.logsumexp(scores.to(lse.dtype), dim=-1)  # [H, n]
        out[qs] = (torch.exp(scores.to(lse.dtype) - seg_lse.unsqueeze(-1)).to(q.dtype) @ v).transpose(0, 1)
        lse[:, qs] = seg_lse
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def sdpa_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                  dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                                  window_size_right=None, upper_left=False):
    """``aten::_flash_attention_backward`` on the varlen path: the flash backward from the kept
    output and log-sum-exp (no forward recomputed), K/V gradients summed over each head group."""
    assert dropout_p == 0.0 and rng_state.shape == (2,) and unused.numel() == 0
    assert grad_out.shape == out.shape == query.shape and grad_out.is_contiguous() and out.is_contiguous()
    assert logsumexp.shape == (query.shape[1], query.shape[0]), "logsumexp is not the forward's [H, Tq]"
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for qs, ks, mask in _flash_pair_segments(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                             window_size_left, upper_left):
        q, o, g = (t[qs].transpose(0, 1) for t in (query, out, grad_out))  # [H, n, d]
        k, v = (t[ks].transpose(0, 1).repeat_interleave(group, dim=0) for t in (key, value))
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        p = torch.exp(scores - logsumexp[:, qs].unsqueeze(-1).to(scores.dtype))  # softmax, from the lse
        d_p = g @ v.transpose(1, 2)
        d_s = p * (d_p - (g * o).sum(-1, keepdim=True))
        dq[qs] = (d_s @ k * scale).transpose(0, 1)
        dk_full = d_s.transpose(1, 2) @ q * scale  # [H, m, d]
        dv_full = p.transpose(1, 2) @ g
        dk[ks] = dk_full.reshape(kv_heads, group, *dk_full.shape[1:]).sum(1).transpose(0, 1)
        dv[ks] = dv_full.reshape(kv_heads, group, *dv_full.shape[1:]).sum(1).transpose(0, 1)
    return dq, dk, dv
