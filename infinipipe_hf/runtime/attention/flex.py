"""FlexAttention backend: one fused call per unit, the unit's masks as one block mask.

Design: the unit is one FlexAttention problem.  Queries are the unit's tokens; keys are, per
segment, its context followed by its own K/V, concatenated in segment order (the varlen layout).
A *segment-id / position table* describes both: for query ``i`` its segment and its position in
its sequence (``context + local index``), for key ``j`` its segment and its position.  The
mask_mod allows a pair when the segments match and the key's position is at most the query's
(causal aligned to the lower right of each segment's keys), and, with a sliding window ``W``,
when the query is fewer than ``W`` positions ahead (HF's window).  So packs, slices with context
and hybrids are all the same mask_mod over different tables.

The block mask depends only on the unit's geometry (query offsets, context lengths, window,
device), not on the layer: it is built once per geometry and kept in a small cache, so every
decoder layer of a stage (and the recompute of a checkpointed one) reuses it.  Its tile lists are
computed from the segments (:func:`segment_blocks`, equal to what ``create_block_mask`` finds by
evaluating the mask_mod on every pair: tested), because ``create_block_mask`` either materialises
the dense ``[T, T + context]`` mask (eager) or goes through ``torch.compile`` (cold compiles, long
at some lengths), both costly for units of every size; the mask_mod still runs inside the
partial tiles.  Grouped K/V heads are passed as they are (``enable_gqa``).  On CUDA the call is ``torch.compile``d (Triton
kernels); on CPU it runs eagerly, forward only: torch 2.13's FlexAttention has no CPU backward, so
this backend refuses to run with gradients on CPU rather than let torch fail deep inside a layer.
Dropout (which FlexAttention does not have) goes to the SDPA backend for that call: exact, slower.

``keep_attn`` does not need this backend's log-sum-exp: that level runs its own forward/backward
kernel pair (``kept_kernels.py``) whatever the backend, because FlexAttention has no public
backward that starts from a kept output and log-sum-exp.  :func:`flex_unit_attention` returns the
log-sum-exp (natural log, ``[1, heads, T]`` like the kept pair's) for callers that want it.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments

BLOCK_SIZE = 128
_CACHE_MAX = 8
_MASKS: OrderedDict[tuple, object] = OrderedDict()
_STATS = {"built": 0}
_COMPILED: dict = {}


def flex_importable() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def backward_runs(device: torch.device | str) -> bool:
    """Whether FlexAttention's backward runs on ``device`` (CUDA only, in torch 2.13)."""
    return torch.device(device).type == "cuda"


def flex_available(device: torch.device | str) -> bool:
    """FlexAttention imports and its kernels can run on ``device``: CUDA with Triton; CPU eagerly
    (forward only, see :func:`backward_runs`)."""
    device = torch.device(device)
    if not flex_importable() or device.type not in ("cpu", "cuda"):
        return False
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
    return True


def block_masks_built() -> int:
    """How many block masks this process has built (tests count them across layers)."""
    return _STATS["built"]


def clear_block_masks() -> None:
    _MASKS.clear()


def segment_tables(a: AttentionSegments, device) -> tuple[torch.Tensor, ...]:
    """``(q_seg, q_pos, k_seg, k_pos)`` int32: each query's and key's segment and position."""
    n = len(a.keys)
    lengths = torch.tensor([a.q_offsets[i + 1] - a.q_offsets[i] for i in range(n)])
    contexts = torch.tensor(list(a.context_lens))
    seg_ids = torch.arange(n)
    q_seg = seg_ids.repeat_interleave(lengths)
    # query position = its index in the unit - its segment's first index + the segment's context
    q_shift = torch.tensor(list(a.q_offsets[:-1])) - contexts
    q_pos = torch.arange(a.q_offsets[-1]) - q_shift.repeat_interleave(lengths)
    key_lens = contexts + lengths
    k_seg = seg_ids.repeat_interleave(key_lens)
    k_starts = torch.cumsum(key_lens, 0) - key_lens
    k_pos = torch.arange(int(key_lens.sum())) - k_starts.repeat_interleave(key_lens)
    return tuple(_to_device(t.to(torch.int32), device) for t in (q_seg, q_pos, k_seg, k_pos))


def make_mask_mod(q_seg, q_pos, k_seg, k_pos, sliding_window: int | None):
    """The mask_mod over the tables: same segment, lower-right causal, optional window."""
    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (q_seg[q_idx] == k_seg[kv_idx]) & (k_pos[kv_idx] <= q_pos[q_idx])
        if sliding_window is not None:
            allowed = allowed & (q_pos[q_idx] - k_pos[kv_idx] < sliding_window)
        return allowed

    return mask_mod


def segment_blocks(a: AttentionSegments, block: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``[q blocks, kv blocks]`` (host): the tiles holding any allowed pair, and the tiles
    whose every pair is allowed (inside both lengths; FlexAttention skips the mask_mod there).

    Computed from the segments, not by evaluating the mask_mod on every pair: a query row of a
    segment with context ``C`` at local index ``t`` sees the segment's keys ``[lo, C + t]`` (``lo``
    0, or ``C + t - W + 1`` with a window ``W``), an interval that grows with ``t``; so the rows of
    one segment inside one query tile see the union ``[lo(first row), hi(last row)]``, and the tile
    is full where every row sees all of a key tile (``lo(last row) <= its first key``,
    ``hi(first row) >= its last key``)."""
    n_q, n_k = a.q_offsets[-1], sum(a.context_lens) + a.q_offsets[-1]
    qb, kb = -(-n_q // block), -(-n_k // block)
    any_pair = torch.zeros(qb, kb, dtype=torch.bool)
    full = torch.zeros(qb, kb, dtype=torch.bool)
    k_start = 0
    for i, ctx in enumerate(a.context_lens):
        q0, q1 = a.q_offsets[i], a.q_offsets[i + 1]
        k_end = k_start + ctx + q1 - q0
        t0, t1, c0, c1 = q0 // block, (q1 - 1) // block + 1, k_start // block, (k_end - 1) // block + 1
        tiles, cols = torch.arange(t0, t1), torch.arange(c0, c1)  # only this segment's tiles
        r0 = torch.clamp(tiles * block, min=q0)  # the segment's first and last row in each query tile
        r1 = torch.clamp((tiles + 1) * block, max=q1) - 1
        (lo0, hi0), (lo1, hi1) = (_row_keys(r, q0, ctx, k_start, a.sliding_window) for r in (r0, r1))
        any_pair[t0:t1, c0:c1] |= (cols >= (lo0 // block)[:, None]) & (cols <= (hi1 // block)[:, None])
        whole = (r0 == tiles * block) & (r1 == (tiles + 1) * block - 1)  # the tile is all this segment's
        covered = (cols * block >= lo1[:, None]) & ((cols + 1) * block - 1 <= hi0[:, None])
        full[t0:t1, c0:c1] |= covered & whole[:, None] & ((cols + 1) * block <= n_k)
        k_start = k_end
    return any_pair, full


def _row_keys(rows: torch.Tensor, q0: int, ctx: int, k_start: int, window: int | None):
    """The first and last key (unit-wide index) that query ``rows`` of a segment see."""
    hi = k_start + ctx + (rows - q0)
    lo = torch.full_like(rows, k_start) if window is None else torch.clamp(hi - window + 1, min=k_start)
    return lo, hi


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; from pinned memory on CUDA, so the copy is queued, not synced."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _ordered(dense: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [1, 1, rows], indices [1, 1, rows, cols]) int32: each row's tiles first, ascending."""
    counts = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return _to_device(counts[None, None], device), _to_device(indices[None, None].contiguous(), device)


def unit_block_mask(a: AttentionSegments):
    """The unit's block mask, built on the first call for its geometry and cached."""
    from torch.nn.attention.flex_attention import BlockMask

    device = a.query.device
    key = (str(device), tuple(a.q_offsets), tuple(a.context_lens), a.sliding_window)
    hit = _MASKS.get(key)
    if hit is not None:
        _MASKS.move_to_end(key)
        return hit
    any_pair, full = segment_blocks(a)
    kv_num, kv_idx = _ordered(any_pair & ~full, device)
    full_num, full_idx = _ordered(full, device)
    mask_mod = make_mask_mod(*segment_tables(a, device), a.sliding_window)
    hit = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod,
                                   seq_lengths=(a.q_offsets[-1], sum(a.context_lens) + a.q_offsets[-1]))
    _STATS["built"] += 1
    if len(_MASKS) >= _CACHE_MAX:
        _MASKS.popitem(last=False)
    _MASKS[key] = hit
    return hit


def _compiled(name: str, fn):
    """``torch.compile(fn)``, made once per process (as torchtitan compiles FlexAttention)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn)
    return _COMPILED[name]


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled("flex_attention", flex_attention) if device.type == "cuda" else flex_attention


def flex_unit_attention(a: AttentionSegments, return_lse: bool = False):
    """``(out [1, T, heads, d], lse [1, heads, T] or None)`` of the unit, one FlexAttention call."""
    from torch.nn.attention.flex_attention import AuxRequest

    q = a.query
    k = a.keys[0] if len(a.keys) == 1 else torch.cat(a.keys, dim=2)
    v = a.values[0] if len(a.values) == 1 else torch.cat(a.values, dim=2)
    if not torch.is_grad_enabled():  # torch refuses leaves that require grad on CPU, even here
        q, k, v = q.detach(), k.detach(), v.detach()
    kw = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if return_lse:
        kw["return_aux"] = AuxRequest(lse=True)
    with warnings.catch_warnings():
        # CPU runs the unfused reference implementation on purpose (tests, the profiler).
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        res = _flex_fn(q.device)(q, k, v, block_mask=unit_block_mask(a), scale=a.scaling, **kw)
    out, lse = (res[0], res[1].lse) if return_lse else (res, None)
    return out.transpose(1, 2), lse


def _needs_grad(a: AttentionSegments) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (a.query, *a.keys, *a.values))


def flex_backend(a: AttentionSegments) -> torch.Tensor:
    """``AttentionBackend``: the unit through FlexAttention (SDPA for a call with dropout)."""
    if a.dropout > 0:
        return sdpa_backend(a)
    if _needs_grad(a) and not backward_runs(a.query.device):
        raise ValueError(f"attention_backend='flex' cannot train on {a.query.device.type}: FlexAttention's "
                         f"backward runs only on CUDA in torch {torch.__version__} (its forward runs here, "
                         f"under torch.no_grad()); use attention_backend='sdpa' or 'auto'")
    return flex_unit_attention(a)[0]
