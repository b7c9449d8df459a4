"""CUDA attention backends for units: torch's varlen attention and flash-attn varlen.

Design: a unit is already the varlen problem these kernels solve.  Queries are the unit's tokens
(``cu_seqlens_q`` = the segments' query offsets); keys are, per segment, its context from the KV
store followed by its own K/V, concatenated in segment order (``cu_seqlens_k`` = cumulative
``context + length``).  Causality is aligned to the *lower right* of each segment's block, which
is what both kernels do for ``max_q < max_k`` (flash-attn >= 2.1 ``causal=True``; torch's
``varlen_attn`` ``window_size=(-1, 0)`` maps to the flash kernel's ``is_causal``): query ``i`` of a
segment with context ``C`` sees keys ``0 .. C + i``.  One kernel call serves a whole packed or
hybrid unit, instead of the SDPA backend's Python loop and dense masks.

Trade-offs and guards:
- The kernels run only fp16/bf16 without dropout and without a sliding window narrower than the
  keys; anything else falls back to the SDPA backend for that call (exact, slower), so the
  backend choice can never change results beyond floating-point rounding.
- The first call per (device, dtype) runs a self-check against SDPA with an explicit
  lower-right mask (a slice with context and a packed pair, grouped-query heads).  Semantics of
  ``varlen_attn`` moved between torch releases (``is_causal`` became ``window_size``; cuDNN may be
  preferred over flash; ``enable_gqa`` appeared later), so the check decides at run time whether
  K/V heads can be passed grouped or must be expanded, and disables the backend with a warning
  when causality is not lower-right aligned, instead of training on a wrong mask.
- ``cu_seqlens`` tensors are cached per (device, offsets) so the decoder layers of a unit share one
  host-to-device copy, and ``max_q``/``max_k`` are host integers: no device sync per layer.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import AttentionSegments, register_backend, sdpa_backend, segment_mask

# kernel(q [Tq,H,d], k [Tk,KV,d], v, cu_q, cu_k, max_q, max_k, scale, grouped) -> [Tq,H,d]
Kernel = Callable[..., torch.Tensor]

_HALF = (torch.float16, torch.bfloat16)
_CU_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_CU_CACHE_MAX = 256


def cu_seqlens(q_offsets: tuple[int, ...], key_lens: tuple[int, ...],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``cu_seqlens`` for queries and keys on ``device``, cached across layers."""
    device = torch.device(device)
    key = (str(device), tuple(q_offsets), tuple(key_lens))
    hit = _CU_CACHE.get(key)
    if hit is None:
        cu_k = [0]
        for n in key_lens:
            cu_k.append(cu_k[-1] + n)
        if len(_CU_CACHE) >= _CU_CACHE_MAX:
            _CU_CACHE.clear()
        host = [torch.tensor(x, dtype=torch.int32) for x in (q_offsets, cu_k)]
        if device.type == "cuda":
            # A copy from pageable memory synchronises the stream; a pinned one is queued.
            host = [t.pin_memory() for t in host]
        hit = tuple(t.to(device, non_blocking=True) for t in host)
        _CU_CACHE[key] = hit
    return hit


def kernel_can_run(a: AttentionSegments) -> bool:
    """Whether the fused kernels compute exactly this problem (else: SDPA fallback)."""
    q = a.query
    if q.device.type != "cuda" or q.dtype not in _HALF or a.dropout > 0 or q.shape[-1] > 256:
        return False
    if a.sliding_window is not None:
        longest = max(c + (a.q_offsets[i + 1] - a.q_offsets[i]) for i, c in enumerate(a.context_lens))
        if a.sliding_window < longest:
            return False
    return True


def run_kernel(a: AttentionSegments, kernel: Kernel, grouped: bool) -> torch.Tensor:
    """Pack the unit, run ``kernel`` once, return ``[1, T, heads, d]`` like ``sdpa_backend``."""
    q = a.query[0].transpose(0, 1)  # [T, H, d]
    heads, kv_heads = q.shape[1], a.keys[0].shape[1]
    if len(a.keys) == 1:
        k, v = a.keys[0], a.values[0]
    else:
        k, v = torch.cat(a.keys, dim=2), torch.cat(a.values, dim=2)
    k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [Tk, KV, d]
    if kv_heads != heads and not grouped:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    lengths = [a.q_offsets[i + 1] - a.q_offsets[i] for i in range(len(a.keys))]
    key_lens = tuple(c + n for c, n in zip(a.context_lens, lengths))
    cu_q, cu_k = cu_seqlens(a.q_offsets, key_lens, q.device)
    out = kernel(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max(lengths),
                 max(key_lens), a.scaling, kv_heads != heads and grouped)
    return out.unsqueeze(0)


# --- the kernels ------------------------------------------------------------------------------
def torch_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, grouped):
    from torch.nn.attention.varlen import varlen_attn

    kw = {"scale": scale}
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, lower-right aligned by the flash kernel
    else:
        kw["is_causal"] = True  # torch 2.9/2.10 spelling
    if grouped:
        kw["enable_gqa"] = True
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def flash_attn_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, grouped):
    from flash_attn import flash_attn_varlen_func

    # flash-attn takes grouped K/V heads natively; causal=True is bottom-right aligned (>= 2.1).
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                                  softmax_scale=scale, causal=True)


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, grouped):
    """What the fused kernels compute, in plain PyTorch (any device/dtype): for tests."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)  # [H, n, d]
        ks, vs = (t[ck[i]:ck[i + 1]].transpose(0, 1) for t in (k, v))
        if ks.shape[0] != qs.shape[0]:
            ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], dim=0)
            vs = vs.repeat_interleave(qs.shape[0] // vs.shape[0], dim=0)
        n, m = qs.shape[1], ks.shape[1]
        mask = segment_mask(n, m - n, None, q.device)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


# --- self-check and backend construction ----------------------------------------------------
def _self_check(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    """(usable, grouped_ok): does ``kernel`` match lower-right-causal SDPA on this device/dtype?"""
    g = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, d = 4, 2, 64
    q_offsets, ctx = (0, 48, 48 + 80), [96, 0]  # a slice with 96 tokens of context, a packed doc
    T = q_offsets[-1]
    query = torch.randn(1, heads, T, d, device=device, dtype=dtype, generator=g)
    keys = [torch.randn(1, kv_heads, c + (q_offsets[i + 1] - q_offsets[i]), d, device=device, dtype=dtype,
                        generator=g) for i, c in enumerate(ctx)]
    # Own generator throughout: the global RNG (dropout, checkpoint replay) must not move.
    values = [torch.randn(k.shape, device=device, dtype=dtype, generator=g) for k in keys]
    a = AttentionSegments(query, keys, values, q_offsets, ctx, d ** -0.5, 0.0, None)
    want = sdpa_backend(AttentionSegments(query.float(), [k.float() for k in keys],
                                          [v.float() for v in values], q_offsets, ctx, d ** -0.5, 0.0, None))
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for grouped in (True, False):
        try:
            with torch.no_grad():
                got = run_kernel(a, kernel, grouped).float()
        except Exception:  # grouped heads unsupported by this build: try expanded heads
            continue
        if torch.allclose(got, want, atol=tol, rtol=tol):
            return True, grouped
    return False, False


def make_backend(kernel: Kernel, name: str, *, check: bool = True):
    """An ``AttentionBackend`` running ``kernel`` where it applies, else ``sdpa_backend``."""
    checked: dict[tuple, tuple[bool, bool]] = {}

    def backend(a: AttentionSegments) -> torch.Tensor:
        if not kernel_can_run(a):
            return sdpa_backend(a)
        key = (str(a.query.device), a.query.dtype)
        state = checked.get(key)
        if state is None:
            state = _self_check(kernel, a.query.device, a.query.dtype) if check else (True, True)
            checked[key] = state
            if not state[0]:
                warnings.warn(f"attention backend {name!r} does not match lower-right causal SDPA on "
                              f"{key[0]} {key[1]} (torch {torch.__version__}); using SDPA instead",
                              RuntimeWarning, stacklevel=2)
        if not state[0]:
            return sdpa_backend(a)
        return run_kernel(a, kernel, grouped=state[1])

    backend.__name__ = f"{name}_backend"
    return backend


def varlen_available(device: torch.device) -> bool:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_available(device: torch.device) -> bool:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # absent, or built for another torch/CUDA
        return False
    return True


varlen_backend = make_backend(torch_varlen_kernel, "varlen")
flash_backend = make_backend(flash_attn_kernel, "flash")


def register_cuda_backends() -> None:
    register_backend("varlen", varlen_backend, varlen_available)
    register_backend("flash", flash_backend, flash_available)


register_cuda_backends()
