"""Why the checkpoint MILP rarely beat its greedy start: time limit, gap or formulation?

For every batch of the planner benchmark, EPP is planned with whole layers and diagonal-shared
counts (the paper's formulation); on that plan's first replica the checkpoint problem is then
solved every way the solver can: the greedy, the LP relaxation rounded up and pruned, the LP bound,
HiGHS' MILP under several wall-clock limits (objective, proven gap) -- and the same with a count
per (stage, unit) (``cell``) and with the levels inside a layer.  Each answer is simulated, so the
table shows what each choice does to the step, not only to the recompute sum.

    python -m benchmarks.planner.solver_study [--quick]   # writes benchmarks/results/solver_study.json

Recompute seconds and step times are simulated with the cost model (shipped H100/bf16 profile,
80 GiB); solver times are wall-clock on the machine that runs this (a loaded machine stretches
them, and with them what a time limit buys).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.paths import RESULTS
from benchmarks.planner.planner_tables.setups import SETUPS, batches
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.checkpointing import lp
from infinipipe_hf.planner.checkpointing import solver as cs
from infinipipe_hf.planner.checkpointing.greedy import greedy_counts
from infinipipe_hf.planner.checkpointing.problem import build_problem
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.simulate.simulator import simulate

MILP_LIMITS_S = (0.25, 2.0, 10.0)


def _simulated(plan, cost, prob, x) -> dict:
    cols = prob.columns_from_vars(x)
    ck, levels = cs._assemble(plan, [prob], [cols])
    trial = dataclasses.replace(plan, checkpoint_layers=ck, checkpoint_levels=levels)
    trial.__dict__.pop("unit_by_id", None)
    sim = simulate(trial, cost)
    return {"recompute_s": float(x @ prob.var_cost_s), "step_time_s": sim.step_time_s,
            "bubble_fraction": sim.bubble_fraction, "fits": bool(sim.feasible)}


def _milp(prob, limit_s: float) -> dict:
    t0 = time.perf_counter()
    res = lp.run_milp(prob, limit_s, 1e-4)
    out = {"limit_s": limit_s, "wall_s": time.perf_counter() - t0, "status": int(res.status),
           "gap": getattr(res, "mip_gap", None), "message": str(res.message)[:60]}
    if res.x is not None:
        x = lp.close_chains(prob, np.clip(np.round(res.x), 0, prob.var_ub).astype(np.int64))
        if not cs._fits(prob, prob.columns_from_vars(x)):
            x = greedy_counts(prob, x)
        out["x"] = x
    return out


def study(plan, cost, levels, sharing, milp_limits) -> dict:
    prob = build_problem(plan, cost, 0, levels=levels, sharing=sharing)
    out = {"levels": list(levels), "sharing": sharing, "variables": prob.num_vars,
           "binding_rows": int((prob.need > 0).sum())}
    t0 = time.perf_counter()
    g = greedy_counts(prob)
    out["greedy"] = dict(_simulated(plan, cost, prob, g), wall_s=time.perf_counter() - t0)
    t0 = time.perf_counter()
    rounded, bound = lp.lp_rounding(prob, 60.0)
    out["lp_rounding"] = dict(_simulated(plan, cost, prob, rounded), wall_s=time.perf_counter() - t0)
    out["lp_bound_s"] = bound
    for limit in milp_limits:
        m = _milp(prob, limit)
        x = m.pop("x", None)
        out[f"milp_{limit:g}s"] = dict(m, **(_simulated(plan, cost, prob, x) if x is not None else {}))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "solver_study.json"))
    args = p.parse_args(argv)
    rows = []
    for model, pp in (SETUPS[:1] if args.quick else SETUPS):
        spec = ModelSpec.from_json_file(config_path(model))
        cost = CostModel(spec, dims=ParallelDims(pp_degree=pp), memory_budget_bytes=80 * GIB)
        for name, lengths in batches(args.quick).items():
            res = plan_step(lengths, spec, ParallelDims(pp_degree=pp), PlanOptions(checkpoint_levels=(), checkpoint_sharing="diagonal"), cost=cost)
            row = {"model": model, "pp": pp, "batch": name, "units": len(res.plan.units)}
            if build_problem(res.plan, cost, 0).need.max(initial=0) <= 0:
                row["note"] = "fits without checkpointing"
            else:
                row["diagonal"] = study(res.plan, cost, (), "diagonal", MILP_LIMITS_S)
                row["cell"] = study(res.plan, cost, (), "cell", MILP_LIMITS_S[1:2])
                row["cell_levels"] = study(res.plan, cost, ("mlp", "mlp_act"), "cell", MILP_LIMITS_S[1:2])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k in ("model", "batch", "units", "note")}
                             | {k: {kk: (vv.get("recompute_s"), vv.get("step_time_s")) if isinstance(vv, dict)
                                    else vv for kk, vv in row[k].items() if kk not in ("levels",)}
                                for k in ("diagonal", "cell", "cell_levels") if k in row}), flush=True)
    report = {"machine": platform.platform(), "note": "recompute and step times simulated (H100/bf16 "
              "profile, 80 GiB); wall_s measured here", "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
