"""Per-layer and per-unit stage costs from stages of two depths run through ``StageRunner``.

A one-layer stage's time on a unit is one layer plus what the stage pays once per unit (unit
tensors, rotary tables, the attention context, the launches around one call); a profile fitted
on it alone charges that once-per-unit work to every layer of a deep stage.  Here every unit
shape runs on middle stages of two depths (default 1 and 3 layers) interleaved round by round,
timed like ``runtime_rows.py`` (per-thread CPU seconds on CPU, wall seconds between device
synchronisations on CUDA).  Per shape, the difference of the two depths over their layer
difference is one layer's time, and the rest (the intercept) is the stage's per-unit cost:

    layer = (t_hi - t_lo) / (hi - lo)        unit = t_lo - lo * layer

The layer rows feed the cost model's usual fit (``runtime_fit.fit_runtime_profile``), the median
intercept becomes the profile's ``stage_unit_s`` (forward and backward), and per unit kind and
attention backend the intercepts are reported beside it.  Trade-off: a difference of two noisy
times is noisier than either; the fit runs over many shapes and the intercept is a median.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Mapping, Sequence

import torch

from benchmarks.lib.runtime_fit import error_entry, row_segments
from benchmarks.lib.runtime_rows import UnitCase, _place, _prepare_units, _Sampler, _unit_round
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile


def unit_kind(segments) -> str:
    """``whole`` (one sequence from 0), ``slice`` (one with context), ``pack`` (several whole
    sequences) or ``hybrid`` (a slice plus whole sequences)."""
    sliced = any(a > 0 for a, _ in segments)
    if len(segments) == 1:
        return "slice" if sliced else "whole"
    return "hybrid" if sliced else "pack"


def check_depths(depths: Sequence[int]) -> tuple[int, int]:
    """The two distinct depths (low, high), each >= 1; ``ValueError`` otherwise."""
    ds = sorted(set(int(d) for d in depths))
    if len(ds) != 2 or ds[0] < 1:
        raise ValueError(f"depths must be two distinct layer counts >= 1 (e.g. 1,3), got {list(depths)}")
    return ds[0], ds[1]


def measure_depth_rows(model, cases: Sequence[UnitCase], depths: Sequence[int] = (1, 3), *,
                       backend: str = "auto", repeat: int = 5, warmup: int = 1, seed: int = 0,
                       device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[dict]:
    """``unit_stage`` rows: every case on a middle stage of each depth (``model`` needs at least
    ``max(depths) + 2`` decoder layers; it is copied, not pruned), rounds interleaved over depths."""
    from infinipipe_hf.runtime.stage.module import build_stage
    from infinipipe_hf.runtime.stage.runner import StageRunner

    lo, hi = check_depths(depths)
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    if len(model.model.layers) < hi + 2:
        raise ValueError(f"a middle stage of {hi} layers needs a model with >= {hi + 2} decoder layers, "
                         f"got {len(model.model.layers)}")
    where = _place(model, device, dtype)
    runs = []
    for d in (lo, hi):
        runner = StageRunner(build_stage(copy.deepcopy(model), 1, range(1, 1 + d)), attention_backend=backend)
        runs.append((d, runner, _prepare_units(cases, runner.stage.hidden_size, _Sampler(*where, seed))))
    for r in range(warmup + repeat):
        for _, runner, prepared in runs:
            _unit_round(runner, prepared, timed=r >= warmup)
    rows = []
    for d, runner, prepared in runs:
        name = getattr(runner.backend, "__name__", str(runner.backend)).removesuffix("_backend")
        for case, *_, fwd, bwd in prepared:
            rows.append({"kind": "unit_stage", "segments": [list(s) for s in case.segments], "depth": d,
                         "backend": backend, "backend_used": name, "tokens": case.tokens,
                         "fwd_s": fwd.seconds(), "bwd_s": bwd.seconds(), "fwd_wall_s": fwd.wall_seconds(),
                         "bwd_wall_s": bwd.wall_seconds(), "repeat": repeat})
    return rows


def split_depths(rows: Sequence[Mapping]) -> list[dict]:
    """Per (shape, backend): one layer's and the stage's per-unit seconds, forward and backward."""
    by: dict[tuple, dict[int, Mapping]] = {}
    for r in rows:
        if r.get("kind") == "unit_stage":
            by.setdefault((tuple(map(tuple, r["segments"])), r["backend"]), {})[int(r["depth"])] = r
    out = []
    for (segs, backend), at in by.items():
        lo, hi = check_depths(list(at))
        entry = {"segments": [list(s) for s in segs], "backend": backend, "kind": unit_kind(segs),
                 "tokens": at[lo]["tokens"], "depths": [lo, hi]}
        for k in ("fwd", "bwd"):
            layer = (at[hi][f"{k}_s"] - at[lo][f"{k}_s"]) / (hi - lo)
            entry[f"layer_{k}_s"] = layer
            entry[f"unit_{k}_s"] = at[lo][f"{k}_s"] - lo * layer
        out.append(entry)
    return out


def layer_rows(split: Sequence[Mapping], floor_s: float = 1e-9) -> list[dict]:
    """``unit_layer`` rows (one layer, no checkpoint level) from :func:`split_depths`, for
    ``runtime_fit.fit_layer``; a layer time the noise made <= 0 is floored at ``floor_s``."""
    return [{"kind": "unit_layer", "segments": s["segments"], "level": None, "tokens": s["tokens"],
             "fwd_s": max(s["layer_fwd_s"], floor_s), "bwd_s": max(s["layer_bwd_s"], floor_s)} for s in split]


def stage_unit_fit(split: Sequence[Mapping]) -> dict[str, float]:
    """The profile's ``stage_unit_s``: median intercept per direction, floored at 0."""
    if not split:
        raise ValueError("fitting the per-unit stage cost needs at least one shape measured at two depths")
    return {name: max(float(statistics.median(s[f"unit_{k}_s"] for s in split)), 0.0)
            for name, k in (("forward", "fwd"), ("backward", "bwd"))}


def per_kind_split(split: Sequence[Mapping]) -> dict:
    """Per backend and unit kind: shapes, median per-unit stage seconds, and the median share of
    a one-layer stage that is per-unit work (what a one-layer profile charged to the layer)."""
    out: dict[str, dict] = {}
    for s in split:
        out.setdefault(s["backend"], {}).setdefault(s["kind"], []).append(s)
    report = {}
    for backend, kinds in out.items():
        report[backend] = {}
        for kind, ss in kinds.items():
            row = {"shapes": len(ss)}
            for k in ("fwd", "bwd"):
                row[f"unit_{k}_s"] = float(statistics.median(x[f"unit_{k}_s"] for x in ss))
                row[f"unit_share_of_one_layer_{k}"] = float(statistics.median(
                    x[f"unit_{k}_s"] / max(x[f"unit_{k}_s"] + x[f"layer_{k}_s"], 1e-12) for x in ss))
            report[backend][kind] = row
    return report


def depth_errors(profile: HardwareProfile, spec: ModelSpec, rows: Sequence[Mapping]) -> list[dict]:
    """Measured / predicted of every ``unit_stage`` row, on a middle stage of the row's depth."""
    costs: dict[int, CostModel] = {}
    out = []
    for r in rows:
        if r.get("kind") != "unit_stage":
            continue
        d = int(r["depth"])
        if d not in costs:
            costs[d] = CostModel(dataclasses.replace(spec, num_layers=d + 2), profile,
                                 ParallelDims(pp_degree=3), layers_per_stage=[1, d, 1])
        shape = costs[d].shape_of(row_segments(r))
        pred = (costs[d].compute.forward_time(1, shape), costs[d].backward_time(1, shape))
        out.append(error_entry(r, ("kind", "segments", "depth", "backend", "tokens"), pred))
    return out
