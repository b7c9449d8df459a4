"""Planner benchmark: EPP against its baselines on real and published-shape batches, side by side.

Every schedule plans the same global batch under the same cost model (the shipped H100/bf16
profile unless ``--profile`` is given) and memory budget; each baseline is tuned over its own knob
(packing length, uniform slice count, least uniform checkpointing that fits).  Reported figures are
*simulated* tokens/s from the cost model, not measured GPU throughput; planning time is measured
wall time on the machine that runs this script.

    python -m benchmarks.planner.planner_bench                 # every table; the first writes benchmarks/results/planner_bench.json
    python -m benchmarks.planner.planner_bench --quick         # fewer batches, for CI
    python -m benchmarks.planner.planner_bench --only paper_layout,sp_limits   # some tables only
    python -m benchmarks.planner.planner_bench --only paper_table --render     # print (and refresh) a table's markdown from its JSON

Besides the table of this file (``baselines``), each table lives in its own module under
``benchmarks/planner/planner_tables/`` and writes ``benchmarks/results/planner_<name>.json`` (with a
``markdown`` rendering of the table inside).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.lib.paths import RESULTS
from benchmarks.planner.planner_tables import TABLES
from benchmarks.planner.planner_tables.setups import SETUPS, batches
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.calibration import pricing_line, pricing_record
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.registry import ALTERNATIVES
from infinipipe_hf.planner.registry import PIPELINE_SCHEDULES as SCHEDULES
from infinipipe_hf.planner.search.api import PlanOptions, plan_step


def run(quick: bool, profile_path: str | None, memory_gib: float) -> dict:
    profile = HardwareProfile.load(profile_path) if profile_path else None
    results = []
    for model, pp in (SETUPS[:1] if quick else SETUPS):
        spec = ModelSpec.from_json_file(config_path(model))
        cost = CostModel(spec, profile, ParallelDims(pp_degree=pp), memory_budget_bytes=memory_gib * GIB)
        for name, lengths in batches(quick).items():
            row = {"model": model, "pp": pp, "batch": name, "num_sequences": len(lengths),
                   "num_tokens": sum(lengths), "longest": max(lengths), "schedules": {}}
            for schedule in SCHEDULES:
                res = plan_step(lengths, spec, ParallelDims(pp_degree=pp), PlanOptions(schedule=schedule), cost=cost)
                row["schedules"][schedule] = res.summary()
            base = {s: r["tokens_per_s"] for s, r in row["schedules"].items() if s != "epp"}
            best_name = max(base, key=base.get)
            epp = row["schedules"]["epp"]["tokens_per_s"]
            row["best_baseline"] = best_name
            row["epp_speedup_vs_best_baseline"] = epp / base[best_name] if base[best_name] > 0 else None
            row["epp_planning_time_s"] = row["schedules"]["epp"]["planning_time_s"]
            results.append(row)
            print(format_row(row), flush=True)
    return {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
            "memory_budget_gib": memory_gib, "profile": profile_path or "shipped h100-bf16-default",
            "note": "tokens/s are simulated with the cost model; planning_time_s is measured here",
            "results": results}


def format_row(row: dict) -> str:
    parts = [f"{row['model']:>10} pp{row['pp']} {row['batch']:<26} {row['num_tokens'] / 1e6:6.2f}M tok"]
    for s in SCHEDULES:
        r = row["schedules"][s]
        parts.append(f"{s}={r['tokens_per_s'] / 1e3:7.1f}K" if r["feasible"] else f"{s}=   OOM  ")
    sp = row["epp_speedup_vs_best_baseline"]
    parts.append(f"speedup={sp:.2f}x vs {row['best_baseline']}" if sp else "speedup=n/a")
    epp = row["schedules"]["epp"]
    if epp["feasible"]:
        parts.append(f"rec={epp['recompute_fraction']:.3f} bub={epp['bubble_fraction']:.3f}")
    parts.append(f"plan={row['epp_planning_time_s']:.2f}s")
    return "  ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", default=None)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--out", default=str(RESULTS / "planner_bench.json"))
    names = ["baselines", *TABLES]
    p.add_argument("--only", default=",".join(names), help=f"comma-separated tables among {', '.join(names)}")
    p.add_argument("--render", action="store_true",
                   help="do not plan: rewrite each chosen table's markdown from its results JSON and print it")
    args = p.parse_args(argv)
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        p.error(f"unknown table(s) {', '.join(unknown)}; choose among {', '.join(names)}")
    if args.render:
        for name in chosen:
            if name != "baselines":
                render_table(TABLES[name], Path(args.out).parent / f"planner_{name}.json")
        return 0
    if "baselines" in chosen:
        t0 = time.perf_counter()
        report = run(args.quick, args.profile, args.gpu_memory_gib)
        report["wall_time_s"] = time.perf_counter() - t0
        report["pricing"] = pricing_record(HardwareProfile.load(args.profile) if args.profile else default_profile(),
                                           ALTERNATIVES)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out} ({report['wall_time_s']:.1f} s)")
    profile = HardwareProfile.load(args.profile) if args.profile else None
    for name in chosen:
        if name != "baselines":
            run_table(TABLES[name], args.quick, profile, args.profile, args.gpu_memory_gib,
                      Path(args.out).parent / f"planner_{name}.json")
    return 0


def run_table(module, quick: bool, profile, profile_path: str | None, memory_gib: float, out: Path) -> None:
    """Run one ``planner_tables`` module and write its JSON report (markdown table included)."""
    print(f"== {module.NAME}: {module.DESCRIPTION}", flush=True)
    t0 = time.perf_counter()
    report = module.run(quick, profile, memory_gib)
    priced = profile or default_profile()
    print(pricing_line(priced, ALTERNATIVES), flush=True)
    report.update(table=module.NAME, description=module.DESCRIPTION, quick=quick,
                  machine=platform.platform(), processor=platform.processor() or platform.machine(),
                  profile=profile_path or f"shipped default ({priced.name})",
                  pricing=pricing_record(priced, ALTERNATIVES), load_average=os.getloadavg(),
                  note="tokens/s are simulated with the cost model; planning_time_s is measured here",
                  wall_time_s=time.perf_counter() - t0)
    report["markdown"] = module.markdown(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(report["markdown"])
    print(f"wrote {out} ({report['wall_time_s']:.1f} s)", flush=True)


def render_table(module, path: Path) -> None:
    """Refresh the ``markdown`` of a table's results JSON from its rows (no planning)."""
    report = json.loads(path.read_text())
    report["markdown"] = module.markdown(report)
    path.write_text(json.dumps(report, indent=1))
    print(report["markdown"])


if __name__ == "__main__":
    sys.exit(main())
