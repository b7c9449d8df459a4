"""Fit a cost profile to rows timed through the runtime (CPU), and check it on held-out rows.

The rows (``runtime_rows.py`` and the benchmark's point-to-point probe) time what a
pipeline action is made of, each on its own: a decoder layer's forward and backward on units of
every kind the planner builds (whole sequences, slices carrying context, packs), the same with a
checkpoint level (whole layer, ``mlp``, ``mlp_act``), the chunked loss, the embedding, the
elementwise product the ``mlp_act`` level redoes, gloo point-to-point messages, and the allocator
peaks of a one-layer unit at each level (the working memory of ``planner/cost/working.py``).  The fit keeps
the cost model's own form (``planner/cost/profile.py``): per layer and direction
``a1 * sum(s^2 + 2 C s) + a2 * sum(s) + b``, fitted by non-negative least squares on relative
error over the level-free unit rows of *all* kinds at once, so slices and packs pin the
coefficients as much as whole sequences do; the head is ``a2 * tokens + b`` (its backward row
includes the logits recompute, which the cost model adds as one more head forward); a message
costs ``latency + bytes / bandwidth`` of wall time and, where the rows count it (``cpu_s``: gloo
moves bytes on CPU threads), ``p2p_cpu_s + bytes * p2p_cpu_s_per_byte`` of CPU on its two ends.
Recompute is not fitted: the cost model derives it from the forward fit
(``planner/cost/levels.py``) and the level rows are there to *check* that.

:func:`row_errors` predicts every row with :class:`CostModel` (a middle stage of one layer, as
the rows were measured) and returns measured / predicted, so a fit can be judged on shapes it
never saw (the benchmark holds some out).  Trade-off: one linear form for every unit kind is
what the planner can optimise in closed form; where the kernels disagree with it (a dense-mask
slice on CPU costs a little more per pair than a causal square) the residual shows up in the
held-out errors rather than in a special case.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

from infinipipe_hf.ir.levels import FULL, CheckpointMix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, TimeCoefficients


def reference_of(spec: ModelSpec) -> dict[str, Any]:
    """The ``reference`` block of a profile measured on ``spec``'s own layer shape."""
    return {"model_type": spec.model_type, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size}


def row_segments(row: Mapping[str, Any]) -> tuple[Segment, ...]:
    return tuple(Segment(i, int(a), int(b)) for i, (a, b) in enumerate(row["segments"]))


def _nnls_relative(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1.0 / np.maximum(y, 1e-12)
    coef, _ = nnls(features * w[:, None], y * w)
    return coef


def fit_layer(rows: Sequence[Mapping[str, Any]], key: str, context_pairs: str = "band") -> TimeCoefficients:
    """``key`` (``fwd_s`` / ``bwd_s``) of level-free ``unit_layer`` rows as a layer's coefficients,
    pairs counted as ``context_pairs`` (``HardwareProfile.context_pairs``) says the kernel runs them."""
    rows = [r for r in rows if r.get("kind") == "unit_layer" and r.get("level") is None]
    if len(rows) < 3:
        raise ValueError(f"fitting a layer needs >= 3 unit_layer rows without a checkpoint level, got {len(rows)}")
    shapes = [UnitShape.of(row_segments(r), context_pairs) for r in rows]
    x = np.array([[s.pairs, s.tokens, 1.0] for s in shapes])
    a1, a2, b = _nnls_relative(x, np.array([r[key] for r in rows], dtype=float))
    return TimeCoefficients(float(a1), float(a2), float(b))


def fit_tokens(tokens: Iterable[float], seconds: Iterable[float]) -> TimeCoefficients:
    """``seconds = token_s * tokens + fixed_s`` (no attention term)."""
    t = np.asarray(list(tokens), dtype=float)
    y = np.asarray(list(seconds), dtype=float)
    if len(t) < 2:
        raise ValueError(f"fitting a per-token cost needs >= 2 rows, got {len(t)}")
    a2, b = _nnls_relative(np.stack([t, np.ones_like(t)], axis=1), y)
    return TimeCoefficients(0.0, float(a2), float(b))


def fit_p2p(rows: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) of ``p2p`` rows (``bytes``, one-way ``seconds``)."""
    rows = [r for r in rows if r.get("kind") == "p2p"]
    if len(rows) < 2:
        raise ValueError(f"fitting point-to-point costs needs >= 2 p2p rows (message sizes), got {len(rows)}")
    coef = fit_tokens([r["bytes"] for r in rows], [r["seconds"] for r in rows])
    bandwidth = 1.0 / coef.token_s if coef.token_s > 0 else float("inf")
    return coef.fixed_s, bandwidth


def fit_runtime_profile(rows: Sequence[Mapping[str, Any]], spec: ModelSpec, *, name: str,
                        base: HardwareProfile | None = None, **fields: Any) -> HardwareProfile:
    """A profile of ``spec``'s shape from runtime rows (module docstring).

    Fields the rows do not determine come from ``base`` (default: zero-initialised times, the
    dataclass defaults) and then from ``fields`` (e.g. ``bytes_per_element=4``, memory figures); the
    layer is fitted with the pairs ``fields``' (else ``base``'s) ``context_pairs`` counts."""
    context_pairs = fields.get("context_pairs", base.context_pairs if base is not None else "band")
    layer_fwd = fit_layer(rows, "fwd_s", context_pairs)
    layer_bwd = fit_layer(rows, "bwd_s", context_pairs)
    loss = [r for r in rows if r.get("kind") == "unit_loss"]
    head_fwd = fit_tokens([r["tokens"] for r in loss], [r["fwd_s"] for r in loss])
    # The backward row reruns each chunk's head forward (checkpointed); the cost model adds that.
    head_bwd = fit_tokens([r["tokens"] for r in loss],
                          [max(r["bwd_s"] - head_fwd(0, r["tokens"]), 1e-9) for r in loss])
    got: dict[str, Any] = {"layer_forward": layer_fwd, "layer_backward": layer_bwd,
                           "head_forward": head_fwd, "head_backward": head_bwd}
    emb = [r for r in rows if r.get("kind") == "embedding"]
    if emb:
        # The cost model charges the same per-token cost forward and backward.
        got["embedding_token_s"] = float(np.median([(r["fwd_s"] + r["bwd_s"]) / 2 / r["tokens"] for r in emb]))
    act = [r["bytes_per_s"] for r in rows if r.get("kind") == "elementwise"]
    if act:
        got["elementwise_bytes_per_s"] = float(statistics.median(act))
    if any(r.get("kind") == "p2p" for r in rows):
        got["p2p_latency_s"], got["p2p_bandwidth_bytes_per_s"] = fit_p2p(rows)
        cpu = [r for r in rows if r.get("kind") == "p2p" and "cpu_s" in r]
        if cpu:
            coef = fit_tokens([r["bytes"] for r in cpu], [r["cpu_s"] for r in cpu])
            got["p2p_cpu_s"], got["p2p_cpu_s_per_byte"] = coef.fixed_s, coef.token_s
    if any(r.get("kind") == "unit_memory" for r in rows):
        bpe = fields.get("bytes_per_element", base.bytes_per_element if base is not None else 2)
        got["layer_working_bytes_per_token"], got["working_bytes_per_token"] = fit_working_memory(
            rows, spec.hidden_size * bpe)
    if base is None:
        zero = TimeCoefficients()
        base = HardwareProfile(name=name, reference=reference_of(spec), layer_forward=zero, layer_backward=zero,
                               head_forward=zero, head_backward=zero, activation_bytes_per_token_per_layer=0.0,
                               layer_working_bytes_per_token=0.0)
    return dataclasses.replace(base, name=name, reference=reference_of(spec), **{**got, **fields})


def fit_working_memory(rows: Sequence[Mapping[str, Any]], hidden_bytes_per_token: float
                       ) -> tuple[float, dict[str, float]]:
    """``(layer_working_bytes_per_token, working_bytes_per_token)`` from ``unit_memory`` rows (one
    layer, one whole sequence, levels None / full / mlp / mlp_act), decomposed as the phase model
    of ``planner/cost/working.py`` composes them: a one-layer unit's forward peak beyond what it keeps
    is ``T * (F(level) + 2 * hidden)``, its backward peak beyond that ``T * (G + 2 * hidden)``."""
    by = {r.get("level"): r for r in rows if r.get("kind") == "unit_memory"}
    if set(by) != {None, FULL, "mlp", "mlp_act"}:
        raise ValueError(f"fitting working memory needs unit_memory rows at levels None, full, mlp and "
                         f"mlp_act; got {sorted(map(str, by))}")

    def per_token(r, key, minus=0.0):
        return max((r[key] - minus) / r["tokens"] - 2 * hidden_bytes_per_token, 0.0)

    forward = {lv: per_token(r, "fwd_peak_bytes", r["kept_bytes"]) for lv, r in by.items()}
    fields = {"backward": per_token(by[None], "bwd_peak_bytes"), "forward_full": forward[FULL],
              "forward_mlp": forward["mlp"], "forward_mlp_act": forward["mlp_act"]}
    return forward[None], fields


def _probe_cost(spec: ModelSpec, profile: HardwareProfile) -> CostModel:
    """The cost model of the rows' probe: a middle stage of one layer (3 stages of one layer)."""
    return CostModel(dataclasses.replace(spec, num_layers=3), profile, ParallelDims(pp_degree=3), layers_per_stage=[1, 1, 1])


def predict_row(cost: CostModel, row: Mapping[str, Any]) -> tuple[float, float] | None:
    """(forward, backward) seconds the cost model gives a row, or None for rows it does not time."""
    kind = row.get("kind")
    if kind == "unit_layer":
        shape = cost.shape_of(row_segments(row))
        level = row.get("level")
        mix = CheckpointMix(full=1) if level == FULL else CheckpointMix.of(0, {level: 1} if level else None)
        bwd = cost.backward_time(1, shape, mix.full) + cost.levels.finer_recompute_s(shape, mix)
        return cost.compute.forward_time(1, shape), bwd
    if kind == "unit_loss":
        f = cost.coefficients.head_fwd(0, row["tokens"])
        return f, cost.coefficients.head_bwd(0, row["tokens"]) + f
    if kind == "embedding":
        t = cost.coefficients.embedding_token_s * row["tokens"]
        return t, t
    return None


def row_errors(profile: HardwareProfile, spec: ModelSpec, rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Per row: measured and predicted forward/backward seconds and measured / predicted."""
    cost = _probe_cost(spec, profile)
    out = []
    for r in rows:
        pred = predict_row(cost, r)
        if pred is None:
            continue
        out.append(error_entry(r, ("kind", "segments", "level", "tokens"), pred))
    return out


def error_entry(row: Mapping[str, Any], keys: Sequence[str], predicted: tuple[float, float]) -> dict:
    """``row``'s ``keys`` with its measured and predicted forward/backward seconds and their ratio."""
    entry = {k: row[k] for k in keys if k in row}
    for key, p in zip(("fwd", "bwd"), predicted):
        entry[f"{key}_measured_s"] = row[f"{key}_s"]
        entry[f"{key}_predicted_s"] = p
        entry[f"{key}_ratio"] = row[f"{key}_s"] / p if p > 0 else float("inf")
    return entry


def _misses(errors: Sequence[Mapping[str, Any]], min_seconds: float = 0.0):
    """``(|measured / predicted - 1|, row, direction)`` of every row and direction measured at
    ``min_seconds`` or more."""
    return ((abs(e[f"{k}_ratio"] - 1.0), e, k) for e in errors for k in ("fwd", "bwd")
            if e[f"{k}_measured_s"] >= min_seconds)


def worst_error(errors: Sequence[Mapping[str, Any]], min_seconds: float = 0.0) -> float:
    """Largest ``|measured / predicted - 1|`` over rows and directions measured at ``min_seconds``
    or more (the embedding's rows take tens of microseconds: a 3x miss there is noise, not cost)."""
    return max((miss for miss, _, _ in _misses(errors, min_seconds)), default=0.0)


def worst_row(errors: Sequence[Mapping[str, Any]]) -> str:
    """The row and direction behind :func:`worst_error`, with its measured time, for reports."""
    miss, e, k = max(_misses(errors), key=lambda t: t[0], default=(0.0, None, ""))
    if e is None:
        return "no rows"
    what = e.get("segments", e.get("tokens"))
    return f"{e['kind']} {what} {k} ({e[f'{k}_measured_s'] * 1e3:.3f} ms, measured/predicted {e[f'{k}_ratio']:.2f})"


def speed_factor(profile: HardwareProfile, spec: ModelSpec, rows: Sequence[Mapping[str, Any]]) -> float:
    """How much slower (> 1) or faster (< 1) the machine runs now than when ``profile`` was fitted:
    the median of measured / predicted over the forward and backward of ``rows`` (speed-probe rows
    of fit shapes, timed just before and after a run).

    Why a median of one factor: a shared machine's speed drifts between a profile fit and a run
    and slows every kernel alike, while the coefficients' *shape* (pairs vs tokens vs levels) is
    what the fit and its held-out check establish.  One factor cannot absorb shape errors, so a
    run checked with it still tests the cost model."""
    ratios = [e[f"{k}_ratio"] for e in row_errors(profile, spec, rows) for k in ("fwd", "bwd")]
    if not ratios:
        raise ValueError("speed_factor needs at least one unit_layer, unit_loss or embedding row")
    return float(statistics.median(ratios))


def rescale_compute(profile: HardwareProfile, factor: float) -> HardwareProfile:
    """``profile`` with every compute cost multiplied by ``factor`` (layers, head, embedding,
    elementwise kernels); transfers and memory fields unchanged."""
    if not factor > 0:
        raise ValueError(f"rescale_compute needs a factor > 0, got {factor!r}")
    return dataclasses.replace(
        profile, layer_forward=profile.layer_forward.scaled(factor, factor),
        layer_backward=profile.layer_backward.scaled(factor, factor),
        head_forward=profile.head_forward.scaled(factor, factor),
        head_backward=profile.head_backward.scaled(factor, factor),
        embedding_token_s=profile.embedding_token_s * factor,
        elementwise_bytes_per_s=profile.elementwise_bytes_per_s / factor,
        meta={**profile.meta, "speed_factor": factor})
