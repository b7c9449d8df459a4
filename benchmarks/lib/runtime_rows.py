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

Times are medians over repeats interleaved over the cases, with wall-clock medians beside them
(``row_clock.py``): per-thread CPU seconds on CPU, where a wall clock also measures the time the
scheduler gave the core away while a thread's CPU time is the work alone, which is what a cost
coefficient stands for (how ranks share cores is the simulator's job); wall seconds between device
synchronisations on CUDA.  The unit, loss and embedding rows run where the model is (or on
``device=`` / ``dtype=``, which move it), their inputs drawn there in the model's dtype.
Trade-off: CPU time still carries cache and memory-bandwidth interference, and the rows exclude
the pipeline's Python glue between actions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from benchmarks.lib.row_clock import RowClock
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


class _Sampler:
    """Random inputs on the rows' device in the model's dtype; one generator stream per call, so
    on CPU the same seed draws the same tensors whatever the device option."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device, self.dtype = device, dtype
        self.g = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, device=self.device, dtype=self.dtype)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g, device=self.device)


def _place(model, device: torch.device | str | None, dtype: torch.dtype | None
           ) -> tuple[torch.device, torch.dtype]:
    """Move ``model`` to ``device`` / ``dtype`` where given; the (device, dtype) its rows run in."""
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    p = next(model.parameters())
    return p.device, p.dtype


def _timing(fwd: RowClock, bwd: RowClock, repeat: int) -> dict:
    return {"fwd_s": fwd.seconds(), "bwd_s": bwd.seconds(), "fwd_wall_s": fwd.wall_seconds(),
            "bwd_wall_s": bwd.wall_seconds(), "repeat": repeat}


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


def _check_repeat(repeat: int, warmup: int) -> None:
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")


def _prepare_units(cases: Sequence[UnitCase], hidden: int, sample: _Sampler) -> list[tuple]:
    """Per case: its plan, context units, measured unit, batch, inputs, output gradients, clocks."""
    prepared = []
    for case in cases:
        plan, ctx_units, main, lengths = _case_plan(case)
        xs = {u.id: sample.randn(1, u.num_tokens, hidden) for u in ctx_units + [main]}
        grads = {u.id: sample.randn(1, u.num_tokens, hidden) for u in ctx_units + [main]}
        batch = [{"input_ids": [0] * n} for n in lengths]
        prepared.append((case, plan, ctx_units, main, batch, xs, grads,
                         RowClock(sample.device), RowClock(sample.device)))
    return prepared


def _unit_round(runner, prepared: list[tuple], timed: bool) -> None:
    """One step per case: context units forward, the measured unit forward and backward (timed
    when ``timed``), context backward, gradients dropped."""
    for case, plan, ctx_units, main, batch, xs, grads, fwd, bwd in prepared:
        runner.begin_step(plan, batch, max(sum(n - 1 for n in plan.sequences), 1))
        for u in ctx_units:
            runner.forward(u.id, xs[u.id])
        if timed:
            fwd.run(lambda: runner.forward(main.id, xs[main.id]))
            bwd.run(lambda: runner.backward(main.id, grads[main.id]))
        else:
            runner.forward(main.id, xs[main.id])
            runner.backward(main.id, grads[main.id])
        for u in reversed(ctx_units):
            runner.backward(u.id, grads[u.id])
        runner.end_step()
        for p in runner.stage.parameters():
            p.grad = None


def measure_unit_rows(model, cases: Sequence[UnitCase], *, repeat: int = 7, warmup: int = 1,
                      seed: int = 0, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> list[dict]:
    """``unit_layer`` rows of ``cases`` on a one-layer middle stage of ``model``.

    ``model`` is an HF causal LM with at least 3 decoder layers (it is pruned in place to layer 1:
    pass a copy), run where it is unless ``device`` / ``dtype`` move it (module docstring)."""
    from infinipipe_hf.runtime.stage.module import build_stage
    from infinipipe_hf.runtime.stage.runner import StageRunner

    _check_repeat(repeat, warmup)
    if len(model.model.layers) < 3:
        raise ValueError(f"measure_unit_rows needs a model with >= 3 decoder layers (a middle stage), "
                         f"got {len(model.model.layers)}")
    sample = _Sampler(*_place(model, device, dtype), seed)
    runner = StageRunner(build_stage(model, 1, range(1, 2)))
    prepared = _prepare_units(cases, runner.stage.hidden_size, sample)
    for r in range(warmup + repeat):
        _unit_round(runner, prepared, timed=r >= warmup)
    return [{"kind": "unit_layer", "segments": [list(s) for s in case.segments], "level": case.level,
             "tokens": case.tokens, **_timing(fwd, bwd, repeat)} for case, *_, fwd, bwd in prepared]


def measure_loss_rows(model, token_counts: Sequence[int], *, loss_chunk_tokens: int, repeat: int = 7,
                      warmup: int = 1, seed: int = 0, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> list[dict]:
    """``unit_loss`` rows: final norm + ``chunked_lm_loss`` forward (with graph) and backward on
    ``tokens`` label tokens, with the runtime's chunking.  ``model`` is pruned in place."""
    from infinipipe_hf.runtime.stage.loss import chunked_lm_loss
    from infinipipe_hf.runtime.stage.module import build_stage

    _check_repeat(repeat, warmup)
    sample = _Sampler(*_place(model, device, dtype), seed)
    n = len(model.model.layers)
    stage = build_stage(model, 1, range(n - 1, n))
    hidden, vocab = stage.hidden_size, int(stage.config.vocab_size)
    prepared = [(t, sample.randn(1, t, hidden), sample.randint(vocab, 1, t), RowClock(sample.device),
                 RowClock(sample.device)) for t in token_counts]
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
    return [{"kind": "unit_loss", "tokens": t, "loss_chunk_tokens": loss_chunk_tokens, **_timing(f, b, repeat)}
            for t, _, _, f, b in prepared]


def measure_embedding_rows(model, token_counts: Sequence[int], *, repeat: int = 7, warmup: int = 1,
                           seed: int = 0, device: torch.device | str | None = None,
                           dtype: torch.dtype | None = None) -> list[dict]:
    """``embedding`` rows: the first stage's lookup forward (with graph) and backward."""
    from infinipipe_hf.runtime.stage.module import build_stage

    _check_repeat(repeat, warmup)
    sample = _Sampler(*_place(model, device, dtype), seed)
    stage = build_stage(model, 0, range(0, 1))
    vocab, hidden = int(stage.config.vocab_size), stage.hidden_size
    prepared = [(t, sample.randint(vocab, 1, t), sample.randn(1, t, hidden), RowClock(sample.device),
                 RowClock(sample.device)) for t in token_counts]
    for r in range(warmup + repeat):
        for t, ids, grad, fwd, bwd in prepared:
            if r < warmup:
                stage.embed(ids).backward(grad)
            else:
                out = fwd.run(lambda: stage.embed(ids))
                bwd.run(lambda: out.backward(grad))
            for p in stage.parameters():
                p.grad = None
    return [{"kind": "embedding", "tokens": t, **_timing(f, b, repeat)} for t, _, _, f, b in prepared]


def measure_elementwise_rows(model, token_counts: Sequence[int], *, repeat: int = 7, warmup: int = 1,
                             seed: int = 0) -> list[dict]:
    """``elementwise`` rows: a layer's ``act_fn(g) * u`` without graph (module docstring)."""
    mlp = model.model.layers[0].mlp
    inter = int(model.config.intermediate_size)
    g = torch.Generator().manual_seed(seed)
    prepared = [(t, torch.randn(t, inter, generator=g), torch.randn(t, inter, generator=g), RowClock())
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
        sec = clock.seconds()
        rows.append({"kind": "elementwise", "tokens": t, "seconds": sec, "wall_s": clock.wall_seconds(),
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
