"""Measurement rows: one decoder layer vs tokens, LM head + loss vs tokens, slice attention.

Row formats are those of the shipped ``profiles/h100_bf16_measurements.json`` so one fitter
(``fit_profile``) reads both the shipped measurements and a fresh profile:

- ``layer_causal``: ``tokens``, ``fwd_ms``, ``fwd_bwd_ms``, ``saved_bytes_per_token``,
  ``fwd_peak_bytes_per_token`` (CUDA only), ``tflops_fwd_bwd``.  One causal sequence through the
  layer, backward with a random output gradient (the gradient's values do not change the cost).
- ``lm_head_ce``: final norm + LM head + float32 cross-entropy (what the runtime's chunked loss
  runs per chunk), ``tokens``, ``fwd_ms``, ``fwd_bwd_ms``.
- ``attn_slice_lower_right`` (optional): SDPA of ``slice`` queries over ``prefix + slice`` keys
  with a lower-right causal mask, fwd+bwd: the attention of a slice carrying earlier K/V.
- ``mlp_act_recompute``: the layer's ``act_fn(g) * u`` on ``tokens x intermediate`` inputs, what
  the ``mlp_act`` checkpoint level redoes in backward; ``bytes_per_s`` = the ``5 * intermediate``
  elements per token it moves over its time (the profile's ``elementwise_bytes_per_s``).
- ``host_copy`` / ``host_adamw``: the host tier's rows (:mod:`.host`).

Forward-only timings run under ``torch.no_grad`` (no graph is built), while ``fwd_bwd_ms`` is
measured separately as one forward with graph plus its backward, which is what a training step
pays; the fitter takes the backward as ``fwd_bwd_ms - fwd_ms``.  The trade-off is that the
backward share absorbs the small cost of recording the graph.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from infinipipe_hf.profiling.modules import ProfiledModules
from infinipipe_hf.profiling.timer import forward_peak_bytes, saved_bytes, time_fn


def _layer_flops_fwd_bwd(m: ProfiledModules, tokens: int) -> float:
    spec = m.spec
    linear = spec.layer_linear_flops_per_token() * tokens
    attn = spec.attention_flops_per_pair() * tokens * tokens / 2  # causal: half the pairs
    return 3.0 * (linear + attn)  # backward ~ 2x forward


def measure_layer(m: ProfiledModules, tokens: int, device: torch.device, dtype: torch.dtype, *,
                  warmup: int = 2, repeat: int = 5) -> dict:
    hidden = m.spec.hidden_size
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=g)
    pos = torch.arange(tokens, device=device).unsqueeze(0)
    cos_sin = m.rotary(x, pos)
    grad = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=g)
    params = list(m.layer.parameters())

    def run(inp):
        out = m.layer(inp, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def fwd():
        with torch.no_grad():
            return run(x)

    def fwd_bwd():
        inp = x.detach().requires_grad_(True)
        out = run(inp)
        out.backward(grad)
        for p in params:
            p.grad = None

    def fwd_graph():
        inp = x.detach().requires_grad_(True)
        return run(inp)

    fwd_ms = time_fn(fwd, device, warmup=warmup, repeat=repeat)
    fwd_bwd_ms = time_fn(fwd_bwd, device, warmup=warmup, repeat=repeat)
    saved = saved_bytes(fwd_graph, exclude=params)
    peak = forward_peak_bytes(fwd_graph, device)
    row = {
        "kind": "layer_causal", "tokens": tokens, "fwd_bwd_ms": fwd_bwd_ms, "fwd_ms": fwd_ms,
        "saved_bytes_per_token": saved / tokens,
        "tflops_fwd_bwd": _layer_flops_fwd_bwd(m, tokens) / (fwd_bwd_ms * 1e-3) / 1e12,
    }
    if peak is not None:
        row["fwd_peak_bytes_per_token"] = peak / tokens
    return row


def measure_head(m: ProfiledModules, tokens: int, device: torch.device, dtype: torch.dtype, *,
                 warmup: int = 2, repeat: int = 5) -> dict:
    hidden, vocab = m.spec.hidden_size, m.spec.vocab_size
    g = torch.Generator(device=device).manual_seed(tokens + 1)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    params = list(m.norm.parameters()) + list(m.lm_head.parameters())

    def run(inp):
        logits = m.lm_head(m.norm(inp))
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # as the runtime's chunked loss and HF's loss do
        return F.cross_entropy(logits, labels, reduction="sum")

    def fwd():
        with torch.no_grad():
            return run(x)

    def fwd_bwd():
        inp = x.detach().requires_grad_(True)
        run(inp).backward()
        for p in params:
            p.grad = None

    fwd_ms = time_fn(fwd, device, warmup=warmup, repeat=repeat)
    fwd_bwd_ms = time_fn(fwd_bwd, device, warmup=warmup, repeat=repeat)
    flops = 3 * 2.0 * hidden * vocab * tokens
    return {"kind": "lm_head_ce", "tokens": tokens, "fwd_bwd_ms": fwd_bwd_ms, "fwd_ms": fwd_ms,
            "tflops": flops / (fwd_bwd_ms * 1e-3) / 1e12}


def measure_slice_attention(m: ProfiledModules, slice_len: int, prefix: int, device: torch.device,
                            dtype: torch.dtype, *, warmup: int = 2, repeat: int = 5) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    spec = m.spec
    g = torch.Generator(device=device).manual_seed(slice_len + prefix)
    q = torch.randn(1, spec.num_attention_heads, slice_len, spec.head_dim, device=device, dtype=dtype,
                    generator=g)
    kv = [torch.randn(1, spec.num_attention_heads, prefix + slice_len, spec.head_dim, device=device,
                      dtype=dtype, generator=g) for _ in range(2)]
    mask = causal_lower_right(slice_len, prefix + slice_len)

    def fwd_bwd():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, *kv))
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
        out.backward(torch.ones_like(out))

    ms = time_fn(fwd_bwd, device, warmup=warmup, repeat=repeat)
    pairs = slice_len * slice_len / 2 + prefix * slice_len
    return {"kind": "attn_slice_lower_right", "slice": slice_len, "prefix": prefix, "fwd_bwd_ms": ms,
            "tflops": 3 * spec.attention_flops_per_pair() * pairs / (ms * 1e-3) / 1e12}


def measure_mlp_act(m: ProfiledModules, tokens: int, device: torch.device, dtype: torch.dtype, *,
                    warmup: int = 2, repeat: int = 5) -> dict:
    inter = m.spec.intermediate_size
    g = torch.Generator(device=device).manual_seed(tokens + 2)
    gate, up = (torch.randn(tokens, inter, device=device, dtype=dtype, generator=g) for _ in range(2))
    act = m.layer.mlp.act_fn

    def run():
        with torch.no_grad():
            return act(gate) * up

    ms = time_fn(run, device, warmup=warmup, repeat=repeat)
    moved = 5 * inter * tokens * gate.element_size()
    return {"kind": "mlp_act_recompute", "tokens": tokens, "ms": ms, "bytes_per_s": moved / (ms * 1e-3)}


def guarded(fn: Callable[[], dict], what: str, device: torch.device, log: Callable[[str], None]) -> dict | None:
    """Run one measurement; an out-of-memory becomes a skipped row, not a failed profile."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  {what}: out of memory, skipped")
        return None


def profile_rows(m: ProfiledModules, lengths: Sequence[int], head_tokens: Sequence[int],
                 slice_attention: Sequence[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                 *, warmup: int, repeat: int, log: Callable[[str], None] = print) -> list[dict]:
    rows: list[dict] = []
    for n in lengths:
        row = guarded(lambda: measure_layer(m, n, device, dtype, warmup=warmup, repeat=repeat),
                      f"layer_causal {n}", device, log)
        if row:
            log(f"  layer {n:>7} tokens: fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms, "
                f"saved {row['saved_bytes_per_token']:.0f} B/token")
            rows.append(row)
    for n in head_tokens:
        row = guarded(lambda: measure_head(m, n, device, dtype, warmup=warmup, repeat=repeat),
                      f"lm_head_ce {n}", device, log)
        if row:
            log(f"  head  {n:>7} tokens: fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms")
            rows.append(row)
    for n in lengths[-1:]:
        row = guarded(lambda: measure_mlp_act(m, n, device, dtype, warmup=warmup, repeat=repeat),
                      f"mlp_act_recompute {n}", device, log)
        if row:
            log(f"  act*mul {n:>7} tokens: {row['ms']:.3f} ms, {row['bytes_per_s'] / 1e9:.1f} GB/s")
            rows.append(row)
    for s, c in slice_attention:
        row = guarded(lambda: measure_slice_attention(m, s, c, device, dtype, warmup=warmup, repeat=repeat),
                      f"attn slice {s} prefix {c}", device, log)
        if row:
            log(f"  attn  slice {s} prefix {c}: fwd+bwd {row['fwd_bwd_ms']:.3f} ms")
            rows.append(row)
    return rows
