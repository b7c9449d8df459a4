"""Attention across slices: an HF ``AttentionInterface`` function driven by the unit's segments.

Design: a stage sets ``config._attn_implementation = "epp"`` and calls each decoder layer with
``epp_unit=EPPUnitContext(...)``; transformers forwards unknown layer kwargs unchanged into the
attention function, so no global state is needed (and the recompute of a checkpointed layer sees
the same context because the checkpoint replays the same kwargs).  No mask function is
registered: transformers skips mask creation for implementations absent from
``AttentionMaskInterface``, and ours builds its masks from the segment table instead.

For every segment the queries are its own tokens and the keys/values are its context (K/V leaves
of earlier slices from the stage's ``KVStore``) followed by its own K/V; the causal mask is aligned
to the lower right (query i sees keys 0..start+i).  Segments of one unit never see each other.
Backends compute that per unit from an ``AttentionSegments`` description; ``"sdpa"`` (explicit
boolean masks, one call per segment: simple and exact, at the price of a Python loop over
segments) is always available; CUDA varlen/flash backends plug in via ``register_backend``.

With sequence parallelism (``EPPUnitContext.sp``) the layer's Q/K/V cover only this rank's
token shard; an all-to-all turns them into all of the unit's tokens for this rank's heads, the
segment logic above runs unchanged on that head-sharded problem (the KV store therefore holds
this rank's heads only), and a second all-to-all returns the output to the rank's tokens.
Backends never learn about SP: they get an ``AttentionSegments`` with fewer heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from infinipipe_hf.ir.units import Segment
from infinipipe_hf.runtime.attention.kv_store import KVStore, PendingKVGrad

if TYPE_CHECKING:
    from infinipipe_hf.runtime.recompute.keep_attn import KeptAttention
    from infinipipe_hf.runtime.parallel.sequence_parallel import SPUnit

EPP_ATTENTION = "epp"


@dataclass
class EPPUnitContext:
    """What the attention function needs to know about the unit being run."""

    unit_id: int
    segments: tuple[Segment, ...]
    q_offsets: tuple[int, ...]  # cu_seqlens of the queries: segment i is tokens [q_offsets[i], q_offsets[i+1])
    continues: tuple[bool, ...]  # segment i's sequence has a later slice that needs its K/V
    store: KVStore
    backend: "AttentionBackend"
    sp: "SPUnit | None" = None
    """Sequence parallelism: the layer sees this rank's token shard; attention runs on all the
    unit's tokens for this rank's heads between two all-to-alls (``sequence_parallel.py``)."""
    kept_attention: "KeptAttention | None" = None
    """Set on the layers checkpointed at ``keep_attn``: the attention core's output and
    log-sum-exp are kept here from the forward for the replay (``attention_kept.py``)."""


@dataclass
class AttentionSegments:
    """One unit's attention problem: queries of all segments, and each segment's full keys."""

    query: torch.Tensor  # [1, heads, T, d]
    keys: list[torch.Tensor]  # per segment [1, kv_heads, context + length, d]
    values: list[torch.Tensor]
    q_offsets: tuple[int, ...]
    context_lens: list[int]
    scaling: float
    dropout: float
    sliding_window: int | None


AttentionBackend = Callable[[AttentionSegments], torch.Tensor]  # returns [1, T, heads, d]


def segment_mask(length: int, context: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean [length, context + length]: causal aligned to the lower right, optional window."""
    q_pos = torch.arange(context, context + length, device=device).unsqueeze(1)
    k_pos = torch.arange(context + length, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window  # HF: kv_idx > q_idx - sliding_window
    return mask


def square_causal(length: int, context: int, sliding_window: int | None) -> bool:
    """A segment with no context and no window narrower than it: plain causal, no mask needed
    (upper-left and lower-right alignment coincide)."""
    return context == 0 and (sliding_window is None or sliding_window >= length)


_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


def sdpa_backend(a: AttentionSegments) -> torch.Tensor:
    heads = a.query.shape[1]
    outs = []
    for i, (k, v) in enumerate(zip(a.keys, a.values)):
        q = a.query[:, :, a.q_offsets[i]:a.q_offsets[i + 1]]
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


_BACKENDS: dict[str, tuple[AttentionBackend, Callable[[torch.device], bool]]] = {
    "sdpa": (sdpa_backend, lambda device: True),
}
_AUTO_ORDER_CUDA = ("flash", "varlen", "sdpa")


def register_backend(name: str, fn: AttentionBackend, is_available: Callable[[torch.device], bool]) -> None:
    """Add a backend (e.g. CUDA varlen / flash-attn); ``is_available(device)`` gates its use."""
    _BACKENDS[name] = (fn, is_available)


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend ``name`` for ``device``; ``"auto"``: flash, then varlen on CUDA, else sdpa."""
    device = torch.device(device)
    # --- hook (issue 6): CUDA varlen/flash backends register themselves on import -----------
    from infinipipe_hf.runtime.attention import varlen as attention_cuda  # noqa: F401
    # ------------------------------------------------------------------------------------------
    if name == "auto":
        order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("sdpa",)
        for cand in order:
            if cand in _BACKENDS and _BACKENDS[cand][1](device):
                return _BACKENDS[cand][0]
        raise AssertionError("sdpa is always available")
    if name not in _BACKENDS:
        known = sorted(set(_BACKENDS) | {"varlen", "flash"})
        raise ValueError(f"attention_backend={name!r} is not available in this installation "
                         f"(registered: {', '.join(sorted(_BACKENDS))}; known: {', '.join(known)}); "
                         f"use 'auto' or 'sdpa'")
    fn, ok = _BACKENDS[name]
    if not ok(device):
        raise ValueError(f"attention_backend={name!r} cannot run on device {device}; use 'auto' or 'sdpa'")
    return fn


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
    keys, values, context_lens, pending = [], [], [], []
    for i, seg in enumerate(ctx.segments):
        a, b = ctx.q_offsets[i], ctx.q_offsets[i + 1]
        k_own, v_own = key[:, :, a:b], value[:, :, a:b]
        if seg.start > 0:
            ck, cv = ctx.store.context(layer, seg.seq, seg.start)
            keys.append(torch.cat([ck, k_own], dim=2))
            values.append(torch.cat([cv, v_own], dim=2))
        else:
            keys.append(k_own)
            values.append(v_own)
        context_lens.append(seg.start)
        if ctx.continues[i]:
            entry = ctx.store.put(layer, seg.seq, seg.start, seg.end, k_own, v_own)
            pending.append((k_own, v_own, entry))
    idx = ctx.sp.comm.expand_index(query.device) if ctx.sp is not None else None
    if idx is not None:
        # This rank's query heads do not group evenly onto its K/V heads: one K/V per query head.
        keys = [k.index_select(1, idx) for k in keys]
        values = [v.index_select(1, idx) for v in values]
    problem = AttentionSegments(query, keys, values, ctx.q_offsets, context_lens, scaling, dropout,
                                kwargs.get("sliding_window"))
    if ctx.kept_attention is not None and torch.is_grad_enabled():
        from infinipipe_hf.runtime.recompute.keep_attn import kept_attention

        out = kept_attention(problem, ctx.kept_attention, layer)
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
