"""Kernel pairs for the ``keep_attn`` level: a forward that also returns the log-sum-exp, and a
backward that starts from the kept output and log-sum-exp instead of recomputing the forward.

Two pairs, chosen by device:
- CPU: torch's flash attention for CPU, one call per segment (an explicit lower-right mask for a
  slice with context), the kernel ``F.scaled_dot_product_attention`` itself runs on CPU, so the
  level's outputs equal the ``sdpa`` backend's bit for bit.
- CUDA: torch's own flash-attention varlen pair (``aten::_flash_attention_forward`` and
  ``_backward``, the pair ``torch.nn.attention.varlen`` runs), one call per unit over the packed
  segments: causal is aligned to the lower right of each segment's keys, grouped K/V heads are
  native, a sliding window narrower than the keys is passed as ``window_size_left``.  float16 and
  bfloat16 only, as the kernels.  The forward's third and fourth outputs (the random-number state
  under its old and new names) go back to the backward in the same positions, which every torch
  since 2.4 accepts.

As in ``varlen.py``, the CUDA pair is plain Python around injected functions
(``flash_varlen_kept_kernel(forward_fn, backward_fn)``): its packing, window arguments,
log-sum-exp hand-over and the split of the key gradients back into segments run in CPU tests, in
float64, against stand-ins with the aten signatures.  What CPU tests cannot show, whether the
installed kernels compute that, :func:`self_check` shows on the device before the level is ever
planned there: forward and backward on a slice with context and a packed document with grouped
heads, with and without a window, against SDPA's autograd.  A pair that raises (an old GPU, a
changed signature) or disagrees is not used: the engine plans without the level, with a warning
carrying the reason, rather than train on a wrong backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments, segment_mask, square_causal
from infinipipe_hf.runtime.attention.varlen import check_problem, pack_unit

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_HALF = (torch.float16, torch.bfloat16)
# Relative (norm) error of output and every gradient against float SDPA the self-check accepts;
# a misaligned mask or a dropped context gradient is off by order one.
_CHECK_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}

Forward = Callable[[AttentionSegments], "tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]"]
Backward = Callable[..., "tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]"]


@dataclass(frozen=True)
class KeptKernel:
    """An attention forward with its log-sum-exp and the backward from them."""

    name: str
    forward: Forward
    """``forward(problem) -> (out [1, T, heads, d], lse, aux)``; ``aux``: further tensors the
    backward needs (the CUDA pair's random-number state), kept with ``lse``."""
    backward: Backward
    """``backward(problem, grad_out, out, lse, aux) -> (dq [1, heads, T, d], per-segment dk,
    per-segment dv)``, shaped like ``problem.query``, ``problem.keys``, ``problem.values``."""


# --- CPU ------------------------------------------------------------------------------------
def _mask_of(query: torch.Tensor, context: int, sliding_window: int | None) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, additive mask or None) of a segment whose queries are ``query`` [1, H, L, d]."""
    length = query.shape[2]
    if square_causal(length, context, sliding_window):
        return True, None
    allowed = segment_mask(length, context, sliding_window, query.device)
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    return False, additive.masked_fill_(~allowed, float("-inf"))


def _cpu_forward(a: AttentionSegments):
    outs, lses = [], []
    for i in range(len(a.keys)):
        q = a.query[:, :, a.q_offsets[i]:a.q_offsets[i + 1]]
        causal, mask = _mask_of(q, a.context_lens[i], a.sliding_window)
        o, lse = _FLASH_CPU(q, a.keys[i], a.values[i], 0.0, causal, attn_mask=mask, scale=a.scaling)
        outs.append(o)
        lses.append(lse)
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2).contiguous()
    return out, (lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)), ()


def _cpu_backward(a: AttentionSegments, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, aux):
    grad_heads, out_heads = grad_out.transpose(1, 2), out.transpose(1, 2)  # the kernel's [1, H, T, d]
    dqs, dks, dvs = [], [], []
    for i in range(len(a.keys)):
        sl = slice(a.q_offsets[i], a.q_offsets[i + 1])
        q = a.query[:, :, sl]
        causal, mask = _mask_of(q, a.context_lens[i], a.sliding_window)
        dq, dk, dv = _FLASH_CPU_BACKWARD(grad_heads[:, :, sl], q, a.keys[i], a.values[i], out_heads[:, :, sl],
                                         lse[:, :, sl], 0.0, causal, attn_mask=mask, scale=a.scaling)
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv)
    return (dqs[0] if len(dqs) == 1 else torch.cat(dqs, dim=2)), dks, dvs


CPU_KERNEL = KeptKernel("flash_cpu", _cpu_forward, _cpu_backward)


# --- CUDA -----------------------------------------------------------------------------------
def _window(a: AttentionSegments, key_lens: tuple[int, ...]) -> dict:
    """Window keywords of the flash pair: HF's window W lets query i see keys i-W+1 .. i."""
    if a.sliding_window is None or a.sliding_window >= max(key_lens):
        return {}
    return {"window_size_left": a.sliding_window - 1, "window_size_right": 0}


def flash_varlen_kept_kernel(forward_fn: Callable | None = None, backward_fn: Callable | None = None) -> KeptKernel:
    """torch's flash-attention varlen pair (or functions with its aten signatures)."""
    forward_fn = forward_fn or torch.ops.aten._flash_attention_forward
    backward_fn = backward_fn or torch.ops.aten._flash_attention_backward

    def forward(a: AttentionSegments):
        p = pack_unit(a, grouped=True)
        out, lse, rng, extra, _ = forward_fn(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, True, False,
                                             scale=a.scaling, **_window(a, p.key_lens))
        return out.unsqueeze(0), lse, (rng, extra)

    def backward(a: AttentionSegments, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, aux):
        p = pack_unit(a, grouped=True)
        dq, dk, dv = backward_fn(grad_out[0].contiguous(), p.q, p.k, p.v, out[0].contiguous(), lse, p.cu_q, p.cu_k,
                                 p.max_q, p.max_k, 0.0, True, aux[0], aux[1], scale=a.scaling,
                                 **_window(a, p.key_lens))
        # [Tk, KV, d] over all segments -> per segment [1, KV, context + length, d]
        per_segment = lambda g: [x.transpose(0, 1).unsqueeze(0) for x in g.split(list(p.key_lens), dim=0)]
        return dq.transpose(0, 1).unsqueeze(0), per_segment(dk), per_segment(dv)

    return KeptKernel("flash_varlen", forward, backward)


# --- self-check and choice --------------------------------------------------------------------
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().to(want.dtype), want.detach()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def self_check(kernel: KeptKernel, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """``None`` when ``kernel`` computes lower-right-causal attention and its gradients from the
    kept output and log-sum-exp on ``device`` in ``dtype``; else what went wrong."""
    device = torch.device(device)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    tol = _CHECK_TOL.get(dtype, 3e-2)
    for window in (None, 64):  # the check problem's segments have 144 and 80 keys
        a = check_problem(device, dtype, window)
        leaf = lambda t: t.detach().to(up).requires_grad_(True)
        ref = AttentionSegments(leaf(a.query), [leaf(k) for k in a.keys], [leaf(v) for v in a.values],
                                a.q_offsets, a.context_lens, a.scaling, 0.0, window)
        with torch.enable_grad():  # the first ask may come from evaluation, under no_grad
            want = sdpa_backend(ref)
            g = torch.randn(want.shape, device=device, dtype=up,
                            generator=torch.Generator(device=device).manual_seed(1))
            want_grads = torch.autograd.grad(want, [ref.query, *ref.keys, *ref.values], g)
        try:
            with torch.no_grad():
                out, lse, aux = kernel.forward(a)
                dq, dks, dvs = kernel.backward(a, g.to(dtype), out, lse, aux)
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use this pair here
            return f"{kernel.name} raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        got = [out, dq, *dks, *dvs]
        names = ["output", "query gradient"] + [f"key gradient {i}" for i in range(len(dks))] + \
                [f"value gradient {i}" for i in range(len(dvs))]
        for name, x, y in zip(names, got, [want, *want_grads]):
            if x.shape != y.shape:
                return f"{kernel.name}: {name} has shape {tuple(x.shape)}, expected {tuple(y.shape)}"
            err = _rel(x, y)
            if not err <= tol:
                return (f"{kernel.name}: {name} is off by {err:.2e} relative to SDPA "
                        f"(window {window}, tolerance {tol:.0e})")
    return None


_CHECKED: dict[tuple[str, torch.dtype], "KeptKernel | str"] = {}


def kernel_for(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> "KeptKernel | str":
    """The pair ``keep_attn`` runs on ``device`` in ``dtype``, or why there is none.  On CUDA the
    first ask per (device, dtype) runs :func:`self_check` there."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_KERNEL
    if device.type != "cuda":
        return f"keep_attn has no attention kernel pair for {device.type} devices (only CPU and CUDA)"
    if dtype not in _HALF:
        return (f"keep_attn on CUDA runs torch's flash-attention kernels, which take float16 or bfloat16, "
                f"not {dtype}")
    if head_dim is not None and (head_dim > 256 or head_dim % 8):
        return f"keep_attn on CUDA needs a head dimension of at most 256 and a multiple of 8, not {head_dim}"
    if not torch.cuda.is_available():
        return "keep_attn on CUDA needs a CUDA device, and none is available"
    if device.index is None:  # "cuda" (the engine's) and "cuda:0" (a tensor's) share one check
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype)
    if key not in _CHECKED:
        kernel = flash_varlen_kept_kernel()
        why = self_check(kernel, device, dtype)
        _CHECKED[key] = kernel if why is None else (
            f"torch's flash-attention pair failed keep_attn's self-check on {device} {dtype} "
            f"(torch {torch.__version__}): {why}")
    return _CHECKED[key]
