"""Plan a *run* (several batches) with every schedule, per batch tuned and as one static setting.

Shared by the paper table and the static-vs-tuned table.  For one model, one pipeline layout and a
list of batches it plans, per batch: EPP (as the runtime runs it, and optionally with the
what-if per-unit gradient reduction), the pipeline baselines tuned per batch, and the non-pipeline
alternatives tuned per batch on the same GPUs; then the best static setting of each baseline and
alternative over the whole run (``benchmarks.lib.static_pipeline`` / ``static_alternative``).
A run's throughput is
its total tokens over its total (simulated) step time.  At ``sp > 1`` EPP runs with elastic SP
rounds (its default) and again on whole SP groups (``epp-whole``); the what-if with per-unit
gradient reduction is planned on whole SP groups.
"""
from __future__ import annotations

import statistics
import time

from benchmarks.lib.static_alternative import static_alternative
from benchmarks.lib.static_pipeline import static_pipeline_baseline
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step, resolve_sp_rounds

from .common import WHOLE, spec_of


def plan_run(batches, model: str, *, pp: int, sp: int = 1, dp: int = 1, shard: str = "none",
             memory_gib: float = 80.0, profile=None, gpus_per_node: int | None = None,
             baselines=("seq1f1b",), alternatives=("ulysses-zero3", "ring-cp", "flexsp"),
             epp_unit_reduce: bool = False, fixed_seq1f1b_slices=(), whole_group_epp: bool = True,
             log=print) -> dict:
    """Per-schedule run throughput (tuned per batch and static) and per-batch details;
    ``fixed_seq1f1b_slices``: also the best static seq1f1b with each of these slice counts
    (keys ``seq1f1b-K<k>``); ``whole_group_epp``: also EPP on whole SP groups where it has rounds."""
    spec = spec_of(model)
    gpn = (profile or default_profile()).gpus_per_node if gpus_per_node is None else gpus_per_node
    dims = ParallelDims(pp_degree=pp, sp_degree=sp, dp_degree=dp, shard=shard, gpus_per_node=gpn)
    cost = CostModel(spec, profile, dims, memory_budget_bytes=memory_gib * GIB)
    world = pp * sp * dp
    flat = FlatCost.of(spec, world, memory_gib * GIB, cost.profile, cost.dims.gpus_per_node)
    unit_cost = None
    if epp_unit_reduce and cost.states.sharded:
        unit_cost = CostModel(spec, profile, dims, memory_budget_bytes=memory_gib * GIB, grad_reduce="unit")
    tokens = [sum(b) for b in batches]
    per: dict[str, list] = {"epp": []}
    rounds = resolve_sp_rounds(None, sp)
    if rounds and whole_group_epp:
        per[WHOLE] = []
    if unit_cost is not None:
        per["epp-unit-reduce"] = []
    tuned_results: dict[str, list] = {s: [] for s in baselines}
    for s in (*baselines, *alternatives):
        per[s] = []
    for i, lengths in enumerate(batches):
        t0 = time.perf_counter()
        runs = [("epp", lambda: plan_step(lengths, spec, ParallelDims(pp_degree=pp, dp_degree=dp, sp_degree=sp, shard=shard), PlanOptions(schedule="epp"), cost=cost))]
        if WHOLE in per:
            runs.append((WHOLE, lambda: plan_step(lengths, spec, ParallelDims(pp_degree=pp, dp_degree=dp, sp_degree=sp, shard=shard), PlanOptions(schedule="epp", sp_rounds=False), cost=cost)))
        if unit_cost is not None:
            runs.append(("epp-unit-reduce", lambda: plan_step(lengths, spec, ParallelDims(pp_degree=pp, dp_degree=dp, sp_degree=sp, shard=shard), PlanOptions(schedule="epp", sp_rounds=False if rounds else None), cost=unit_cost)))
        runs += [(s, lambda s=s: plan_step(lengths, spec, ParallelDims(pp_degree=pp, dp_degree=dp, sp_degree=sp, shard=shard), PlanOptions(schedule=s), cost=cost)) for s in baselines]
        runs += [(s, lambda s=s: plan_alternative(lengths, spec, s, world_size=world, cost=flat)) for s in alternatives]
        for name, make in runs:
            res = make()
            if name in tuned_results:
                tuned_results[name].append(res)
            d = res.summary()
            per[name].append({"feasible": d["feasible"], "step_time_s": d["step_time_s"],
                              "planning_time_s": d["planning_time_s"],
                              "knobs": {k: v for k, v in d.get("info", {}).items()
                                        if k in ("num_slices", "slice_balance", "pack_tokens", "sp_degree", "cp_degree",
                                                 "num_rounds", "checkpoint_layers", "unit_token_floor", "sp_rounds",
                                                 "group_sizes")}})
        log(f"    batch {i}: {tokens[i] / 1e6:.2f}M tokens, longest {max(lengths)}: "
            + "  ".join(f"{n}={_tps(per[n][-1], tokens[i])}" for n in per) + f"  ({time.perf_counter() - t0:.1f} s)")
    out = {"world_size": world, "num_batches": len(batches), "num_tokens": sum(tokens), "tuned": {}, "static": {}}
    for name, rows in per.items():
        ok = all(r["feasible"] for r in rows)
        total = sum(r["step_time_s"] for r in rows) if ok else None
        out["tuned"][name] = {"feasible": ok, "tokens_per_s": sum(tokens) / total if ok else 0.0,
                              "fits_batches": sum(r["feasible"] for r in rows),
                              "planning_time_s_mean": statistics.mean(r["planning_time_s"] for r in rows),
                              "planning_time_s_max": max(r["planning_time_s"] for r in rows),
                              "batches": rows}
    for s in baselines:
        out["static"][s] = static_pipeline_baseline(s, batches, tuned_results[s], cost).summary()
    if "seq1f1b" in baselines:
        for k in fixed_seq1f1b_slices:
            out["static"][f"seq1f1b-K{k}"] = static_pipeline_baseline("seq1f1b", batches, tuned_results["seq1f1b"],
                                                                      cost, num_slices=k).summary()
    for s in alternatives:
        out["static"][s] = static_alternative(s, batches, flat).summary()
    return out


def _tps(row: dict, tokens: int) -> str:
    return f"{tokens / row['step_time_s'] / 1e3:.1f}K" if row["feasible"] else "OOM"


def run_tps(out: dict, name: str, static: bool = False) -> float | None:
    """A run's tokens/s (None when some batch does not fit)."""
    r = (out["static"] if static else out["tuned"]).get(name)
    if r is None or not r["feasible"]:
        return None
    return r["tokens_per_s"]


def fmt_k(x: float | None) -> str:
    return f"{x / 1e3:.1f}K" if x else "OOM"


def fmt_x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"
