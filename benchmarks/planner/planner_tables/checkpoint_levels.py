"""Planner table: checkpoint levels inside a layer, before and after, and equal-memory speedups.

For every batch of the planner benchmark, EPP is planned three ways under the same cost model and
budget: ``whole, diagonal`` (whole layers, counts shared along backward diagonals: the paper's
formulation and this project's before), ``whole, cell`` (whole layers, a count per stage and
unit), ``mlp levels, cell`` (whole layers plus the ``mlp`` / ``mlp_act`` levels inside the MLP)
and ``levels, cell`` (also ``keep_attn``, a whole layer that keeps its attention output and skips
the attention core on replay: the default).  Per plan: simulated tokens/s, the recompute share (recompute seconds over stage
seconds, mean over stages and the worst stage) and the bubble share.

Equal memory: a baseline that fits the budget is compared at it; one that does not is planned at
the least budget (bisected to ``RESOLUTION_GIB``) at which it fits, and EPP (levels off and on) is
planned again at that budget, so every speedup compares plans with the same memory per GPU.
Tokens/s are simulated with the cost model, not measured; planning times (CPU seconds of this
process, which a loaded machine inflates less than wall time) are measured where this runs.
"""
from __future__ import annotations

import time
from collections import defaultdict

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.api import PlanOptions, plan_step

from .common import spec_of
from .setups import SETUPS, batches

NAME = "checkpoint_levels"
DESCRIPTION = ("checkpoint levels inside a layer, before (whole layers, diagonal counts) and after (levels, "
               "per-cell counts): recompute and bubble shares, equal-memory speedups")
VARIANTS = {
    "whole, diagonal": dict(checkpoint_levels=(), checkpoint_sharing="diagonal"),
    "whole, cell": dict(checkpoint_levels=(), checkpoint_sharing="cell"),
    "mlp levels, cell": dict(checkpoint_levels=("mlp", "mlp_act"), checkpoint_sharing="cell"),
    "levels, cell": dict(checkpoint_levels=("keep_attn", "mlp", "mlp_act"), checkpoint_sharing="cell"),
}
BEFORE, MIDDLE, AFTER = "whole, diagonal", "mlp levels, cell", "levels, cell"
COMPARED = (BEFORE, MIDDLE, AFTER)
BASELINES = ("packed-1f1b", "seq1f1b", "gpipe")
RESOLUTION_GIB = 2.0
MAX_BUDGET_GIB = 2048.0


def _plan(lengths, spec, pp, budget_gib, profile, **kw):
    cost = CostModel(spec, profile, ParallelDims(pp_degree=pp), memory_budget_bytes=budget_gib * GIB)
    t0 = time.process_time()
    res = plan_step(lengths, spec, cost.dims, PlanOptions(**kw), cost=cost)
    return res, time.process_time() - t0


def _shares(res) -> dict:
    """Tokens/s, recompute share (mean over stages and worst stage), bubble share of one plan."""
    if not res.feasible:
        return {"feasible": False, "tokens_per_s": 0.0}
    sim = res.simulation
    rec = defaultdict(float)
    for e in sim.events:
        rec[(e.dp_rank, e.stage)] += e.recompute_s
    step = sim.step_time_s
    return {"feasible": True, "tokens_per_s": sim.tokens_per_s, "step_time_s": step,
            "recompute_share": sim.recompute_fraction,
            "recompute_share_worst_stage": max(rec.values(), default=0.0) / step if step else 0.0,
            "bubble_share": sim.bubble_fraction, "recompute_time_s": sim.recompute_time_s,
            "num_slices": res.plan.info.get("num_slices"), "checkpoint_method": res.plan.info.get("checkpoint_method"),
            "finer_level_layers": sum(sum(v.values()) for per in res.plan.checkpoint_levels.values()
                                      for v in per.values())}


def _least_budget(lengths, spec, pp, schedule, profile, lo_gib):
    """Least budget (GiB, to ``RESOLUTION_GIB``) at which ``schedule`` fits, with its plan; None if
    not even ``MAX_BUDGET_GIB``."""
    hi = lo_gib * 2
    res, _ = _plan(lengths, spec, pp, hi, profile, schedule=schedule)
    while not res.feasible:
        if hi >= MAX_BUDGET_GIB:
            return None, None
        lo_gib, hi = hi, min(hi * 2, MAX_BUDGET_GIB)
        res, _ = _plan(lengths, spec, pp, hi, profile, schedule=schedule)
    best = res
    while hi - lo_gib > RESOLUTION_GIB:
        mid = (lo_gib + hi) / 2
        got, _ = _plan(lengths, spec, pp, mid, profile, schedule=schedule)
        if got.feasible:
            hi, best = mid, got
        else:
            lo_gib = mid
    return hi, best


def table_row(model: str, pp: int, spec, name: str, lengths, budget_gib: float, profile) -> dict:
    row = {"model": model, "pp": pp, "batch": name, "budget_gib": budget_gib, "epp": {}, "baselines": {}}
    for label, kw in VARIANTS.items():
        res, cpu = _plan(lengths, spec, pp, budget_gib, profile, **kw)
        row["epp"][label] = dict(_shares(res), planning_cpu_s=cpu, planning_wall_s=res.planning_time_s)
    for schedule in BASELINES:
        res, _ = _plan(lengths, spec, pp, budget_gib, profile, schedule=schedule)
        entry = {"at_budget": _shares(res)}
        if res.feasible:
            entry["fits_at_gib"] = budget_gib
            for label in COMPARED:
                entry[f"speedup_{label}"] = row["epp"][label]["tokens_per_s"] / entry["at_budget"]["tokens_per_s"]
        else:
            need, base = _least_budget(lengths, spec, pp, schedule, profile, budget_gib)
            entry["fits_at_gib"] = need
            if need is not None:
                entry["at_fit"] = _shares(base)
                for label in COMPARED:
                    epp, _ = _plan(lengths, spec, pp, need, profile, **VARIANTS[label])
                    entry[f"epp_at_fit_{label}"] = _shares(epp)
                    entry[f"speedup_{label}"] = (entry[f"epp_at_fit_{label}"]["tokens_per_s"]
                                                 / entry["at_fit"]["tokens_per_s"])
        row["baselines"][schedule] = entry
    return row


def format_row(row: dict) -> str:
    e = row["epp"]
    parts = [f"{row['model']:>10} pp{row['pp']} {row['batch']:<27}"]
    for label in VARIANTS:
        v = e[label]
        parts.append(f"[{label}] {v['tokens_per_s'] / 1e3:5.1f}K rec {v['recompute_share']:.3f} "
                     f"(worst {v['recompute_share_worst_stage']:.3f}) bub {v['bubble_share']:.3f} "
                     f"plan {v['planning_cpu_s']:.1f}s" if v["feasible"] else f"[{label}] OOM")
    for schedule, b in row["baselines"].items():
        at = "" if b["fits_at_gib"] == row["budget_gib"] else f"@{b['fits_at_gib']}GiB "
        sp = ("->".join(f"{b.get('speedup_' + label, 0):.2f}" for label in COMPARED) + "x"
              if b["fits_at_gib"] is not None else "never fits")
        parts.append(f"{schedule} {at}{sp}")
    return "\n    ".join(parts)


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    """Every (model, pp) setup and batch of the planner benchmark (``setups.py``)."""
    rows = []
    for model, pp in (SETUPS[:1] if quick else SETUPS):
        spec = spec_of(model)
        for name, lengths in batches(quick).items():
            row = table_row(model, pp, spec, name, lengths, memory_gib, profile)
            rows.append(row)
            print(format_row(row), flush=True)
    return {"memory_budget_gib": memory_gib, "variants": {k: dict(v) for k, v in VARIANTS.items()},
            "before": BEFORE, "middle": MIDDLE, "after": AFTER, "rows": rows}


def markdown(report: dict) -> str:
    """Before (whole layers, diagonal) -> MLP levels -> with keep_attn (reports written before
    keep_attn existed have no middle variant: two columns then)."""
    labels = [BEFORE, MIDDLE, AFTER] if report.get("middle") else [BEFORE, AFTER]
    arrow = " -> ".join(["whole"] + (["mlp levels"] if len(labels) == 3 else []) + ["all levels"])
    lines = [f"| model, pp | batch | EPP tok/s {arrow} | recompute share {arrow} (worst stage) "
             f"| bubble share {arrow} | equal-memory speedup over the best baseline, {arrow} |",
             "|---|---|---|---|---|---|"]

    def chain(fmt, values):
        return " -> ".join(fmt(v) for v in values)

    for row in report["rows"]:
        plans = [row["epp"][label] for label in labels]
        if not all(p["feasible"] for p in plans):
            continue
        best = max(row["baselines"].items(), key=lambda kv: kv[1].get("at_budget", {}).get("tokens_per_s", 0.0))
        name, base = best
        suffix = f" vs {name}"
        if not base["at_budget"]["feasible"]:  # nothing fits the budget: the one needing the least memory
            fits = [(v["fits_at_gib"], k, v) for k, v in row["baselines"].items() if v["fits_at_gib"]]
            if not fits:
                base = None
            else:
                gib, name, base = min(fits, key=lambda t: t[0])
                suffix = f" vs {name} (at {gib:g} GiB, where it fits)"
        speed = (chain(lambda v: f"{v:.2f}x", [base["speedup_" + label] for label in labels]) + suffix
                 if base is not None else "no baseline fits")
        tok = chain(lambda p: f"{p['tokens_per_s'] / 1e3:.1f}K", plans)
        rec = chain(lambda p: f"{p['recompute_share']:.3f}", plans)
        worst = chain(lambda p: f"{p['recompute_share_worst_stage']:.3f}", plans)
        bub = chain(lambda p: f"{p['bubble_share']:.3f}", plans)
        lines.append(f"| {row['model']}, pp {row['pp']} | {row['batch']} | {tok} | {rec} ({worst}) | {bub} | {speed} |")
    return "\n".join(lines)
