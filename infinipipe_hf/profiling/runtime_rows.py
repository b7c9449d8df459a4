"""Timing rows measured through the runtime's own code path, for CPU cost profiles.

On CPU the runtime's costs differ by shape from one layer on a whole causal sequence (a slice with
context runs SDPA with a dense mask, a packed unit makes one SDPA call per segment, a checkpointed
layer replays part of its forward, the chunked loss recomputes its logits), so every row here is
one *unit* run through ``StageRunner.forward`` / ``backward`` exactly as a pipeline runs it:

- ``unit_layer``: a one-layer middle stage on a unit given by its segments (``[[start, end], ...]``;
  a segment starting after 0 first has its context forwarded into the KV store, untimed) at a
  checkpoint level (``None``, ``full``, ``mlp``, ``mlp_act``).
- ``unit_loss``: the last stage's final norm and chunked LM loss on ``tokens`` label tokens; its
  backward includes the logits recompute.
- ``embedding``: the first stage's embedding lookup and its backward.
- ``unit_memory``: the stage's allocator peaks (``profiling/memory_events.py``) on a whole sequence
  at a level: ``fwd_peak_bytes``, ``kept_bytes`` after the forward, ``bwd_peak_bytes`` above that
  during its backward: the working memory of the planner's phase model.
- ``elementwise``: the MLP's ``act_fn(g) * u``, what the ``mlp_act`` level redoes; ``bytes_per_s``
  counts the ``5 * intermediate`` elements per token it moves.

Times are per-thread CPU seconds (``time.thread_time``), medians over repeats interleaved over the
cases, with wall-clock medians beside them: on a shared machine a wall clock also measures the time
the scheduler gave the core away, while a thread's CPU time is the work alone, which is what a cost
coefficient stands for (how ranks share cores is the simulator's job).  Trade-off: CPU time still
carries cache and memory-bandwidth interference, and the rows exclude the pipeline's Python glue
between actions.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import FINER_LEVELS, FULL, MLP_LEVELS
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit


@dataclass(frozen=True)
class UnitCase:
    """One unit shape to time: segments ``(start, end)`` of distinct sequences and a level."""

    segments: tuple[tuple[int, int], ...]
    """Token ranges of distinct sequences; ``start > 0`` means the slice attends to ``start`` tokens
    of context (its sequence is ``end`` tokens long unless ``continues``)."""
    level: str | None = None
    """Checkpoint level of the stage's one layer: ``None`` (keeps everything), ``"full"``, or one
    of the finer levels ``"mlp"`` / ``"mlp_act"``."""

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a UnitCase needs at least one segment (start, end)")
        for a, b in self.segments:
            if not 0 <= a < b:
                raise ValueError(f"segment ({a}, {b}) must satisfy 0 <= start < end")
        if self.level not in (None, FULL, *FINER_LEVELS):
            raise ValueError(f"level={self.level!r}: use None, {FULL!r} or one of {FINER_LEVELS}")

    @property
    def tokens(self) -> int:
        return sum(b - a for a, b in self.segments)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class _Clock:
    """CPU and wall seconds of one call."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def run(self, fn: Callable[[], object]):
        c0, w0 = time.thread_time(), time.perf_counter()
        out = fn()
        self.wall.append(time.perf_counter() - w0)
        self.cpu.append(time.thread_time() - c0)
        return out


def _case_plan(case: UnitCase) -> tuple[Plan, list[Unit], Unit, list[int]]:
    """A 3-stage plan whose middle stage runs the context units, then the measured unit."""
    lengths, units, segs = [], [], []
    for i, (a, b) in enumerate(case.segments):
        lengths.append(b)
        if a:
            units.append(Unit(len(units), (Segment(i, 0, a),)))
        segs.append(Segment(i, a, b))
    main = Unit(len(units), tuple(segs))
    units.append(main)
    acts = [Action("F", u.id) for u in units] + [Action("B", u.id) for u in reversed(units)]
    full = 1 if case.level == FULL else 0
    levels = {1: {main.id: {case.level: 1}}} if case.level in FINER_LEVELS else {}
    plan = Plan("epp", 3, 1, lengths, units, {0: [[], acts, []]}, {1: {main.id: full}}, [1, 1, 1],
                checkpoint_levels=levels)
    return plan, units[:-1], main, lengths


def measure_unit_rows(model, cases: Sequence[UnitCase], *, repeat: int = 7, warmup: int = 1,
                      seed: int = 0) -> list[dict]:
    """``unit_layer`` rows of ``cases`` on a one-layer middle stage of ``model``.

    ``model`` is a float32 HF causal LM with at least 3 decoder layers (it is pruned in place to
    layer 1: pass a copy)."""
    from infinipipe_hf.runtime.stage.module import build_stage
    from infinipipe_hf.runtime.stage.runner import StageRunner

    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    if len(model.model.layers) < 3:
        raise ValueError(f"measure_unit_rows needs a model with >= 3 decoder layers (a middle stage), "
                         f"got {len(model.model.layers)}")
    runner = StageRunner(build_stage(model, 1, range(1, 2)))
    hidden = runner.stage.hidden_size
    g = torch.Generator().manual_seed(seed)
    prepared = []
    for case in cases:
        plan, ctx_units, main, lengths = _case_plan(case)
        xs = {u.id: torch.randn(1, u.num_tokens, hidden, generator=g) for u in ctx_units + [main]}
        grads = {u.id: torch.randn(1, u.num_tokens, hidden, generator=g) for u in ctx_units + [main]}
        batch = [{"input_ids": [0] * n} for n in lengths]
        prepared.append((case, plan, ctx_units, main, batch, xs, grads, _Clock(), _Clock()))
    for r in range(warmup + repeat):
        for case, plan, ctx_units, main, batch, xs, grads, fwd, bwd in prepared:
            runner.begin_step(plan, batch, max(sum(n - 1 for n in plan.sequences), 1))
            for u in ctx_units:
                runner.forward(u.id, xs[u.id])
            if r < warmup:
                runner.forward(main.id, xs[main.id])
                runner.backward(main.id, grads[main.id])
            else:
                fwd.run(lambda: runner.forward(main.id, xs[main.id]))
                bwd.run(lambda: runner.backward(main.id, grads[main.id]))
            for u in reversed(ctx_units):
                runner.backward(u.id, grads[u.id])
            runner.end_step()
            for p in runner.stage.parameters():
                p.grad = None
    rows = []
    for case, *_, fwd, bwd in prepared:
        rows.append({"kind": "unit_layer", "segments": [list(s) for s in case.segments], "level": case.level,
                     "tokens": case.tokens, "fwd_s": _median(fwd.cpu), "bwd_s": _median(bwd.cpu),
                     "fwd_wall_s": _median(fwd.wall), "bwd_wall_s": _median(bwd.wall), "repeat": repeat})
    return rows


def measure_loss_rows(model, token_counts: Sequence[int], *, loss_chunk_tokens: int, repeat: int = 7,
                      warmup: int = 1, seed: int = 0) -> list[dict]:
    """``unit_loss`` rows: final norm + ``chunked_lm_loss`` forward (with graph) and backward on
    ``tokens`` label tokens, with the runtime's chunking.  ``model`` is pruned in place."""
    from infinipipe_hf.runtime.stage.loss import chunked_lm_loss
    from infinipipe_hf.runtime.stage.module import build_stage

    n = len(model.model.layers)
    stage = build_stage(model, 1, range(n - 1, n))
    hidden, vocab = stage.hidden_size, int(stage.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    prepared = [(t, torch.randn(1, t, hidden, generator=g), torch.randint(0, vocab, (1, t), generator=g),
                 _Clock(), _Clock()) for t in token_counts]
    for r in range(warmup + repeat):
        for t, x, labels, fwd, bwd in prepared:
            leaf = x.detach().requires_grad_(True)

            def forward():
                return chunked_lm_loss(stage.lm_head, stage.final_norm(leaf), labels, t, loss_chunk_tokens)

            if r < warmup:
                forward().backward()
            else:
                loss = fwd.run(forward)
                bwd.run(loss.backward)
            for p in stage.parameters():
                p.grad = None
    return [{"kind": "unit_loss", "tokens": t, "loss_chunk_tokens": loss_chunk_tokens,
             "fwd_s": _median(f.cpu), "bwd_s": _median(b.cpu), "fwd_wall_s": _median(f.wall),
             "bwd_wall_s": _median(b.wall), "repeat": repeat} for t, _, _, f, b in prepared]


def measure_embedding_rows(model, token_counts: Sequence[int], *, repeat: int = 7, warmup: int = 1,
                           seed: int = 0) -> list[dict]:
    """``embedding`` rows: the first stage's lookup forward (with graph) and backward."""
    from infinipipe_hf.runtime.stage.module import build_stage

    stage = build_stage(model, 0, range(0, 1))
    vocab, hidden = int(stage.config.vocab_size), stage.hidden_size
    g = torch.Generator().manual_seed(seed)
    prepared = [(t, torch.randint(0, vocab, (1, t), generator=g), torch.randn(1, t, hidden, generator=g),
                 _Clock(), _Clock()) for t in token_counts]
    for r in range(warmup + repeat):
        for t, ids, grad, fwd, bwd in prepared:
            if r < warmup:
                stage.embed(ids).backward(grad)
            else:
                out = fwd.run(lambda: stage.embed(ids))
                bwd.run(lambda: out.backward(grad))
            for p in stage.parameters():
                p.grad = None
    return [{"kind": "embedding", "tokens": t, "fwd_s": _median(f.cpu), "bwd_s": _median(b.cpu),
             "fwd_wall_s": _median(f.wall), "bwd_wall_s": _median(b.wall), "repeat": repeat}
            for t, _, _, f, b in prepared]


def measure_elementwise_rows(model, token_counts: Sequence[int], *, repeat: int = 7, warmup: int = 1,
                             seed: int = 0) -> list[dict]:
    """``elementwise`` rows: a layer's ``act_fn(g) * u`` without graph (module docstring)."""
    mlp = model.model.layers[0].mlp
    inter = int(model.config.intermediate_size)
    g = torch.Generator().manual_seed(seed)
    prepared = [(t, torch.randn(t, inter, generator=g), torch.randn(t, inter, generator=g), _Clock())
                for t in token_counts]
    with torch.no_grad():
        for r in range(warmup + repeat):
            for t, gate, up, clock in prepared:
                if r < warmup:
                    mlp.act_fn(gate) * up
                else:
                    clock.run(lambda: mlp.act_fn(gate) * up)
    rows = []
    for t, gate, _, clock in prepared:
        sec = _median(clock.cpu)
        rows.append({"kind": "elementwise", "tokens": t, "seconds": sec, "wall_s": _median(clock.wall),
                     "bytes_per_s": 5 * inter * t * gate.element_size() / max(sec, 1e-12), "repeat": repeat})
    return rows


def _allocate_grads(module) -> None:
    """Gradients of the weights exist before a probed backward: they are model states (allocated
    by a step's first backward and counted with the weights), not the unit's working memory."""
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def measure_memory_rows(model, tokens: int, levels: Sequence[str | None] = (None, FULL, *MLP_LEVELS),
                        *, seed: int = 0) -> list[dict]:
    """``unit_memory`` rows of a ``tokens``-token sequence on a one-layer middle stage of ``model``
    (pruned in place) at each of ``levels`` (module docstring).  Byte counts do not depend on load."""
    from infinipipe_hf.profiling.memory_events import MemoryProbe
    from infinipipe_hf.runtime.stage.module import build_stage
    from infinipipe_hf.runtime.stage.runner import StageRunner

    runner = StageRunner(build_stage(model, 1, range(1, 2)))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, runner.stage.hidden_size, generator=g)
    grad = torch.randn(1, tokens, runner.stage.hidden_size, generator=g)
    rows = []
    for level in levels:
        plan, _, main, lengths = _case_plan(UnitCase(((0, tokens),), level))
        runner.begin_step(plan, [{"input_ids": [0] * n} for n in lengths], tokens - 1)
        with MemoryProbe() as fwd:
            runner.forward(main.id, x)
        _allocate_grads(runner.stage)
        with MemoryProbe() as bwd:
            out = runner.backward(main.id, grad)
        del out
        runner.end_step()
        for p in runner.stage.parameters():
            p.grad = None
        rows.append({"kind": "unit_memory", "tokens": tokens, "level": level, "fwd_peak_bytes": fwd.trace.peak_bytes,
                     "kept_bytes": fwd.trace.final_bytes, "bwd_peak_bytes": bwd.trace.peak_bytes})
    return rows
