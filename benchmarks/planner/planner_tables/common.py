"""Helpers shared by the planner benchmark tables: plan a batch with several schedules, summarise."""
from __future__ import annotations

import math

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.registry import ALTERNATIVES
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step, resolve_sp_rounds

WHOLE = "epp-whole"
"""Key of EPP planned with every unit on the whole SP group (``sp_rounds=False``)."""


def spec_of(model: str) -> ModelSpec:
    return ModelSpec.from_json_file(config_path(model))


def plan_schedules(lengths, model: str, schedules, *, pp: int, sp: int = 1, dp: int = 1, shard: str = "none",
                   memory_gib: float = 80.0, profile=None, grad_reduce: str = "step",
                   fixed_seq1f1b_slices: tuple[int, ...] = ()) -> dict[str, dict]:
    """``schedule -> compact summary`` for one batch under one layout (one cost model for all).

    ``fixed_seq1f1b_slices``: also plan seq1f1b with each of these slice counts fixed (keys
    ``seq1f1b-K<k>``), the static setting Seq1F1B runs with.  At ``sp > 1`` EPP runs with elastic
    SP rounds (its default) and is planned again on whole SP groups (key ``epp-whole``)."""
    spec = spec_of(model)
    cost = CostModel(spec, profile, ParallelDims(pp_degree=pp, sp_degree=sp, dp_degree=dp, shard=shard), memory_budget_bytes=memory_gib * GIB, grad_reduce=grad_reduce)
    runs = [(s, None) for s in schedules] + [(f"seq1f1b-K{k}", [k]) for k in fixed_seq1f1b_slices]
    if "epp" in schedules and resolve_sp_rounds(None, sp):
        runs.insert(list(schedules).index("epp") + 1, (WHOLE, None))
    out = {}
    flat = None
    for name, slices in runs:
        if name in ALTERNATIVES:  # not pipelines: the same GPUs, every one running every layer
            if flat is None:
                flat = FlatCost.of(spec, pp * sp * dp, memory_gib * GIB, cost.profile, cost.dims.gpus_per_node)
            res = plan_alternative(lengths, spec, name, world_size=flat.world_size, cost=flat)
            out[name] = compact_alternative(res.summary(), flat)
            continue
        schedule = "seq1f1b" if slices else "epp" if name == WHOLE else name
        res = plan_step(lengths, spec, ParallelDims(pp_degree=pp, dp_degree=dp, sp_degree=sp, shard=shard), PlanOptions(schedule=schedule, num_slices=slices, sp_rounds=False if name == WHOLE else None), cost=cost)
        out[name] = compact(res.summary(), cost)
    return out


def compact_alternative(summary: dict, flat: FlatCost) -> dict:
    """The fields a table needs from an ``AlternativeResult.summary()``."""
    keep = {k: summary[k] for k in ("feasible", "tokens_per_s", "step_time_s", "bubble_fraction", "num_units",
                                    "planning_time_s")}
    keep["peak_memory_gib"] = summary["peak_memory_bytes"][0] / GIB if summary["peak_memory_bytes"] else None
    keep["static_memory_gib"] = flat.states.static_bytes / GIB
    info = summary.get("info", {})
    for key in ("sp_degree", "cp_degree", "pack_tokens", "num_rounds", "checkpoint_layers", "group_sizes"):
        if key in info:
            keep[key] = info[key]
    if "error" in summary:
        keep["error"] = summary["error"]
    return keep


def compact(summary: dict, cost: CostModel) -> dict:
    """The fields a table needs from a ``PlanResult.summary()``."""
    info = summary.get("info", {})
    step = summary["step_time_s"]
    keep = {
        "feasible": summary["feasible"],
        "tokens_per_s": summary["tokens_per_s"],
        "step_time_s": step,
        "bubble_fraction": summary["bubble_fraction"],
        "recompute_share": (summary["recompute_time_s"] / (step * cost.dims.pp_degree * cost.dims.dp_degree)
                            if step else None),
        "peak_memory_gib": max(summary["peak_memory_bytes"]) / GIB if summary["peak_memory_bytes"] else None,
        "static_memory_gib": max(cost.acts.static_bytes(s) for s in range(cost.dims.pp_degree)) / GIB,
        "num_units": summary["num_units"],
        "num_pipelines": summary["num_pipelines"],
        "planning_time_s": summary["planning_time_s"],
    }
    for key in ("num_slices", "slice_balance", "pack_tokens", "token_budget", "unit_token_floor", "sp_rounds"):
        if key in info:
            keep[key] = info[key]
    if "error" in summary:
        keep["error"] = summary["error"]
    return keep


def fmt_tps(row: dict) -> str:
    return f"{row['tokens_per_s'] / 1e3:.1f}K" if row["feasible"] else "OOM"


def ratio(a: dict, b: dict) -> float | None:
    if a["feasible"] and b["feasible"] and b["tokens_per_s"] > 0:
        return a["tokens_per_s"] / b["tokens_per_s"]
    return None


def rounds_text(row: dict) -> str:
    """What a plan's SP rounds look like: ``80 x1, 44 x2, 16 x4, 26 x8 (55 rounds)`` (units per
    sub-group size), ``whole groups`` when the plan has none."""
    r = row.get("sp_rounds") if row.get("feasible") else None
    if not r:
        return "whole groups" if row.get("feasible") else "-"
    sizes = ", ".join(f"{n} x{g}" for g, n in sorted(r["units_per_group_size"].items(), key=lambda kv: int(kv[0])))
    return f"{sizes} ({r['rounds']} rounds)"


def geo_mean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None
