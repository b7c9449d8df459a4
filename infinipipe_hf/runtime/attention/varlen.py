"""CUDA attention backends for units: torch's varlen attention and flash-attn varlen.

Design: a unit is already the varlen problem these kernels solve.  Queries are the unit's tokens
(``cu_seqlens_q`` = the segments' query offsets); keys are, per segment, its context from the KV
store followed by its own K/V, concatenated in segment order (``cu_seqlens_k`` = cumulative
``context + length``).  Causality is aligned to the *lower right* of each segment's block, which
is what both kernels do for ``max_q < max_k`` (flash-attn >= 2.1 ``causal=True``; torch's
``varlen_attn`` ``window_size=(-1, 0)`` maps to the flash kernel's ``is_causal``): query ``i`` of a
segment with context ``C`` sees keys ``0 .. C + i``.  One kernel call serves a whole packed or
hybrid unit, instead of the SDPA backend's Python loop and dense masks.

Everything but the fused call itself is plain Python around an injected function: a
``VarlenKernel`` is built from the attention function (``torch_varlen_kernel(varlen_attn)``,
``flash_attn_kernel(flash_attn_varlen_func)``), so the argument construction, the
``cu_seqlens``/``max_seqlen`` computation, the head layout, the torch-version branches and the
backend around them run in CPU tests against SDPA-built functions with the kernels' signatures.

Trade-offs and guards:
- The kernels run only where ``make_backend`` says (CUDA, fp16/bf16, no dropout, head dim <= 256,
  no sliding window narrower than the keys); anything else falls back to the SDPA backend for
  that call (exact, slower), so the backend choice never changes results beyond rounding.
- Semantics of ``varlen_attn`` moved between torch releases (``is_causal`` became
  ``window_size``; ``enable_gqa`` appeared later; cuDNN may be preferred over flash).  The
  signature decides how causality and grouped K/V heads are passed (no trial and error), and the
  first call per (device, dtype) checks the kernel against SDPA with an explicit lower-right mask
  (a slice with context and a packed pair, grouped-query heads): a kernel that computes something
  else is disabled with a warning instead of training on a wrong mask.  A kernel that *raises*
  is a bug or a broken install and the error propagates.
- ``cu_seqlens`` tensors are cached per (device, offsets) so the decoder layers of a unit share one
  host-to-device copy, and ``max_q``/``max_k`` are host integers: no device sync per layer.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments, square_causal

_HALF = (torch.float16, torch.bfloat16)
_CU_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_CU_CACHE_MAX = 256
# Agreement with float SDPA the self-check requires, per input dtype.
_CHECK_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass(frozen=True)
class VarlenKernel:
    """A fused varlen attention function with this module's argument layout."""

    name: str
    call: Callable[..., torch.Tensor]
    """``call(q [Tq,H,d], k [Tk,KV,d], v, cu_q, cu_k, max_q, max_k, scale) -> [Tq,H,d]``."""
    grouped: bool
    """Takes K/V with fewer heads than Q (grouped-query attention) without expanding them."""


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


def kernel_can_run(a: AttentionSegments, device_types: tuple[str, ...] = ("cuda",),
                   dtypes: tuple[torch.dtype, ...] = _HALF) -> bool:
    """Whether the fused kernels compute exactly this problem (else: SDPA fallback)."""
    q = a.query
    if q.device.type not in device_types or q.dtype not in dtypes or a.dropout > 0 or q.shape[-1] > 256:
        return False
    if a.sliding_window is not None:
        longest = max(c + (a.q_offsets[i + 1] - a.q_offsets[i]) for i, c in enumerate(a.context_lens))
        if a.sliding_window < longest:
            return False
    return True


@dataclass(frozen=True)
class PackedUnit:
    """A unit's attention problem in the varlen layout the fused kernels take."""

    q: torch.Tensor  # [T, heads, d], contiguous
    k: torch.Tensor  # [Tk, kv_heads (or heads, expanded), d]: each segment's context + own keys
    v: torch.Tensor
    cu_q: torch.Tensor  # int32 [segments + 1]
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    key_lens: tuple[int, ...]  # per segment: context + length


def pack_unit(a: AttentionSegments, grouped: bool) -> PackedUnit:
    """The unit's queries and its segments' keys concatenated in segment order (K/V heads
    expanded to the query heads unless the kernel takes ``grouped`` heads)."""
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
    return PackedUnit(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max(lengths),
                      max(key_lens), key_lens)


def run_kernel(a: AttentionSegments, kernel: VarlenKernel) -> torch.Tensor:
    """Pack the unit, run ``kernel`` once, return ``[1, T, heads, d]`` like ``sdpa_backend``."""
    p = pack_unit(a, kernel.grouped)
    return kernel.call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, a.scaling).unsqueeze(0)


# --- the kernels ------------------------------------------------------------------------------
def torch_varlen_kernel(varlen_attn: Callable | None = None) -> VarlenKernel:
    """torch's ``varlen_attn`` (or a function with its signature), called the way this torch
    release spells causality and grouped heads."""
    if varlen_attn is None:
        from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    # window_size=(-1, 0) is causal, lower-right aligned by the flash kernel; torch 2.9/2.10 said
    # is_causal=True for the same thing.
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    grouped = "enable_gqa" in params

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        kw = {"scale": scale, **causal}
        if grouped and k.shape[1] != q.shape[1]:
            kw["enable_gqa"] = True
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    return VarlenKernel("varlen", call, grouped)


def flash_attn_kernel(flash_attn_varlen_func: Callable | None = None) -> VarlenKernel:
    """flash-attn's ``flash_attn_varlen_func`` (or a function with its signature)."""
    if flash_attn_varlen_func is None:
        from flash_attn import flash_attn_varlen_func

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        # causal=True is bottom-right aligned (flash-attn >= 2.1); grouped K/V heads are native.
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                                      softmax_scale=scale, causal=True)

    return VarlenKernel("flash", call, True)


# --- self-check and backend construction ----------------------------------------------------
def check_problem(device: torch.device, dtype: torch.dtype,
                  sliding_window: int | None = None) -> AttentionSegments:
    """A slice with 96 tokens of context and a packed document, grouped-query heads."""
    g = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, d = 4, 2, 64
    q_offsets, ctx = (0, 48, 48 + 80), [96, 0]
    T = q_offsets[-1]
    # Own generator throughout: the global RNG (dropout, checkpoint replay) must not move.
    query = torch.randn(1, heads, T, d, device=device, dtype=dtype, generator=g)
    keys = [torch.randn(1, kv_heads, c + (q_offsets[i + 1] - q_offsets[i]), d, device=device, dtype=dtype,
                        generator=g) for i, c in enumerate(ctx)]
    values = [torch.randn(k.shape, device=device, dtype=dtype, generator=g) for k in keys]
    return AttentionSegments(query, keys, values, q_offsets, ctx, d ** -0.5, 0.0, sliding_window)


def self_check(kernel: VarlenKernel, device: torch.device, dtype: torch.dtype) -> bool:
    """Does ``kernel`` compute lower-right-causal attention (SDPA with an explicit mask) here?"""
    a = check_problem(device, dtype)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    want = sdpa_backend(AttentionSegments(a.query.to(up), [k.to(up) for k in a.keys],
                                          [v.to(up) for v in a.values], a.q_offsets, a.context_lens,
                                          a.scaling, 0.0, None))
    with torch.no_grad():
        got = run_kernel(a, kernel).to(up)
    tol = _CHECK_TOL.get(dtype, 2e-2)
    return bool(torch.allclose(got, want, atol=tol, rtol=tol))


def whole_causal_sequence(a: AttentionSegments) -> bool:
    """One segment with no context: plain causal attention over the whole unit."""
    return len(a.keys) == 1 and square_causal(a.q_offsets[1] - a.q_offsets[0], a.context_lens[0],
                                              a.sliding_window)


def make_backend(name: str, kernel_factory: Callable[[], VarlenKernel], *, check: bool = True,
                 device_types: tuple[str, ...] = ("cuda",), dtypes: tuple[torch.dtype, ...] = _HALF,
                 whole_sequences_to_sdpa: bool = False):
    """An ``AttentionBackend`` running the kernel where it applies, else ``sdpa_backend``.

    ``kernel_factory`` is called on the first call the kernel can serve (so importing this module
    never imports flash-attn); ``device_types``/``dtypes`` say where it may run.
    ``whole_sequences_to_sdpa`` sends units of one whole sequence to SDPA's causal kernel, the
    faster of the two for that case."""
    kernel: list[VarlenKernel] = []
    usable: dict[tuple, bool] = {}

    def backend(a: AttentionSegments) -> torch.Tensor:
        if not kernel_can_run(a, device_types, dtypes) or (whole_sequences_to_sdpa and whole_causal_sequence(a)):
            return sdpa_backend(a)
        if not kernel:
            kernel.append(kernel_factory())
        key = (str(a.query.device), a.query.dtype)
        if key not in usable:
            usable[key] = self_check(kernel[0], a.query.device, a.query.dtype) if check else True
            if not usable[key]:
                warnings.warn(f"attention backend {name!r} does not compute lower-right causal "
                              f"attention on {key[0]} {key[1]} (torch {torch.__version__}); using "
                              f"SDPA instead", RuntimeWarning, stacklevel=2)
        if not usable[key]:
            return sdpa_backend(a)
        return run_kernel(a, kernel[0])

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
    except (ImportError, OSError):  # absent, or built for another torch/CUDA (undefined symbols)
        return False
    return True


varlen_backend = make_backend("varlen", torch_varlen_kernel, whole_sequences_to_sdpa=True)
flash_backend = make_backend("flash", flash_attn_kernel)
