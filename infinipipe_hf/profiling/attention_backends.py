"""The measured attention-backend table: which kernel is fastest for each unit kind on this device.

For each unit kind (:data:`~infinipipe_hf.runtime.attention.types.UNIT_KINDS`) a representative
problem at a few token counts (the unit's query tokens ``T``):
- ``sequence``: one causal sequence of ``T`` tokens;
- ``packed``: ``T`` tokens of documents of ``min(1024, T / 8)`` tokens (16 x 1K at 16K: a pack
  against one sequence of the same tokens is the ``sequence`` row);
- ``slice``: one slice of ``T`` tokens with ``T`` tokens of context;
- ``hybrid``: the last slice of a sequence (``T / 2`` tokens, ``T / 2`` of context) and
  documents of ``min(1024, T / 8)`` tokens for the rest.

Every backend that runs on the device (``select.available_backends``) is timed forward (building
the autograd graph, as training does) and forward + backward where its backward runs
(FlexAttention's does not on CPU: its entries are ``None`` and it is listed under
``forward_only``). The table ranks, per unit kind, the backends that train by their forward +
backward seconds summed over the token counts (the largest count dominates, as it does a step);
``select_backend("auto", ..., table)`` routes by that ranking. A ``budget_s`` bounds the measuring
(a GPU lease is short; FlexAttention compiles on first use): what did not fit is listed under
``not_measured``, and a backend missing a row of a kind is not ranked for it.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from infinipipe_hf.profiling.timer import time_fn
from infinipipe_hf.runtime.attention.select import available_backends, backend_named
from infinipipe_hf.runtime.attention.types import UNIT_KINDS, AttentionSegments

DEFAULT_TOKENS_CUDA = (4096, 16384)
DEFAULT_TOKENS_CPU = (128, 256)


def kind_segments(kind: str, tokens: int) -> tuple[list[int], list[int]]:
    """``(lengths, contexts)`` of the representative problem of ``kind`` with ``tokens`` queries."""
    if kind not in UNIT_KINDS:
        raise ValueError(f"unit kind must be one of {', '.join(UNIT_KINDS)}, got {kind!r}")
    doc = max(min(1024, tokens // 8), 1)
    if kind == "sequence":
        return [tokens], [0]
    if kind == "slice":
        return [tokens], [tokens]
    head, contexts = ([max(tokens // 2, 1)], [max(tokens // 2, 1)]) if kind == "hybrid" else ([], [])
    rest = tokens - sum(head)
    docs = [doc] * (rest // doc) + ([rest % doc] if rest % doc else [])
    return head + docs, contexts + [0] * len(docs)


def kind_problem(kind: str, tokens: int, heads: int, kv_heads: int, head_dim: int, device, dtype,
                 requires_grad: bool) -> AttentionSegments:
    """The representative problem of ``kind``: random Q/K/V leaves from a fixed seed."""
    lengths, contexts = kind_segments(kind, tokens)
    g = torch.Generator(device=device).manual_seed(0)  # own generator: the global RNG must not move

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_(requires_grad)

    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    keys = [leaf(1, kv_heads, c + n, head_dim) for n, c in zip(lengths, contexts)]
    values = [leaf(1, kv_heads, c + n, head_dim) for n, c in zip(lengths, contexts)]
    return AttentionSegments(leaf(1, heads, offsets[-1], head_dim), keys, values, tuple(offsets), contexts,
                             head_dim ** -0.5, 0.0, None)


def _timers(fn: Callable, a: AttentionSegments, trains: bool) -> tuple[Callable, Callable]:
    """Forward as training runs it (building the graph, where the backward runs: one compiled graph
    serves both timings), and forward + backward."""
    def forward():
        with torch.set_grad_enabled(trains):
            return fn(a)

    grad = None

    def forward_backward():
        nonlocal grad
        out = fn(a)
        grad = torch.ones_like(out) if grad is None else grad
        torch.autograd.backward(out, grad)
        for t in (a.query, *a.keys, *a.values):
            t.grad = None

    return forward, forward_backward


def rank(fwd_bwd: dict[str, dict[str, list | None]]) -> dict[str, list[str]]:
    """Per unit kind, the backends with every forward + backward measured, fastest first."""
    out = {}
    for kind, per_backend in fwd_bwd.items():
        done = {n: sum(v) for n, v in per_backend.items() if v and all(x is not None for x in v)}
        out[kind] = sorted(done, key=done.get)
    return out


def attention_table(heads: int, kv_heads: int, head_dim: int, device, dtype, *, tokens=None,
                    warmup: int = 2, repeat: int = 5, budget_s: float = 15.0, log=print) -> dict:
    """Time every available backend on every unit kind; the table ``HardwareProfile`` keeps."""
    device = torch.device(device)
    tokens = sorted(set(int(n) for n in (tokens or (DEFAULT_TOKENS_CUDA if device.type == "cuda"
                                                    else DEFAULT_TOKENS_CPU))))
    if not tokens or tokens[0] < 16 or heads % kv_heads:
        raise ValueError(f"the attention table needs token counts >= 16 (a hybrid unit has a slice and "
                         f"documents) and heads ({heads}) a multiple of kv_heads ({kv_heads}); got tokens "
                         f"{tokens}")
    backends = available_backends(device)
    if device.type == "cuda":
        warmup = max(warmup, 1)  # FlexAttention compiles on its first call: never time that
    fwd = {k: {n: [None] * len(tokens) for n in backends} for k in UNIT_KINDS}
    fwd_bwd = {k: {n: ([None] * len(tokens) if trains else None) for n, trains in backends.items()}
               for k in UNIT_KINDS}
    start, skipped = time.perf_counter(), []
    for name, trains in backends.items():  # backend-major: one backend's compile warms all its rows
        for kind in UNIT_KINDS:
            for i, n in enumerate(tokens):
                if time.perf_counter() - start > budget_s:
                    skipped.append(f"{name}/{kind}/{n}")
                    continue
                a = kind_problem(kind, n, heads, kv_heads, head_dim, device, dtype, requires_grad=trains)
                f, fb = _timers(backend_named(name), a, trains)
                fwd[kind][name][i] = time_fn(f, device, warmup=warmup, repeat=repeat) / 1e3
                if trains:
                    fwd_bwd[kind][name][i] = time_fn(fb, device, warmup=warmup, repeat=repeat) / 1e3
    ranking = rank(fwd_bwd)
    table = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
             "dtype": str(dtype).replace("torch.", ""), "heads": heads, "kv_heads": kv_heads,
             "head_dim": head_dim, "tokens": tokens, "forward_s": fwd, "forward_backward_s": fwd_bwd,
             "forward_only": sorted(n for n, trains in backends.items() if not trains),
             "not_measured": skipped, "ranking": ranking,
             "fastest": {k: r[0] for k, r in ranking.items() if r}}
    log(f"attention backends on {table['device']} ({', '.join(backends)}), fastest per unit kind: "
        f"{table['fastest']}" + (f"; {len(skipped)} rows past the {budget_s:.0f} s budget" if skipped else ""))
    return table
