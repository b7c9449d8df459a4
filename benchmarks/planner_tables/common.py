"""Helpers shared by the planner benchmark tables: plan a batch with several schedules, summarise."""
from __future__ import annotations

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.registry import ALTERNATIVES
from infinipipe_hf.planner.search.api import plan_alternative, plan_step


def spec_of(model: str) -> ModelSpec:
    return ModelSpec.from_json_file(config_path(model))


def plan_schedules(lengths, model: str, schedules, *, pp: int, sp: int = 1, dp: int = 1, shard: str = "none",
                   memory_gib: float = 80.0, profile=None, grad_reduce: str = "step",
                   fixed_seq1f1b_slices: tuple[int, ...] = ()) -> dict[str, dict]:
    """``schedule -> compact summary`` for one batch under one layout (one cost model for all).

    ``fixed_seq1f1b_slices``: also plan seq1f1b with each of these slice counts fixed (keys
    ``seq1f1b-K<k>``), the static setting Seq1F1B runs with."""
    spec = spec_of(model)
    cost = CostModel(spec, profile, pp_degree=pp, sp_degree=sp, dp_degree=dp, shard=shard,
                     memory_budget_bytes=memory_gib * GIB, grad_reduce=grad_reduce)
    runs = [(s, None) for s in schedules] + [(f"seq1f1b-K{k}", [k]) for k in fixed_seq1f1b_slices]
    out = {}
    flat = None
    for name, slices in runs:
        if name in ALTERNATIVES:  # not pipelines: the same GPUs, every one running every layer
            if flat is None:
                flat = FlatCost.of(spec, pp * sp * dp, memory_gib * GIB, cost.profile, cost.layout.gpus_per_node)
            res = plan_alternative(lengths, spec, name, world_size=flat.world_size, cost=flat)
            out[name] = compact_alternative(res.summary(), flat)
            continue
        res = plan_step(lengths, spec, pp_degree=pp, dp_degree=dp, sp_degree=sp, shard=shard,
                        schedule="seq1f1b" if slices else name, num_slices=slices, cost=cost)
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
        "recompute_share": (summary["recompute_time_s"] / (step * cost.pp_degree * cost.dp_degree)
                            if step else None),
        "peak_memory_gib": max(summary["peak_memory_bytes"]) / GIB if summary["peak_memory_bytes"] else None,
        "static_memory_gib": max(cost.static_bytes(s) for s in range(cost.pp_degree)) / GIB,
        "num_units": summary["num_units"],
        "num_pipelines": summary["num_pipelines"],
        "planning_time_s": summary["planning_time_s"],
    }
    for key in ("num_slices", "pack_tokens", "token_budget", "unit_token_floor"):
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
