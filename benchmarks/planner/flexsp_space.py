"""EPP against FlexSP inside EPP's own plan space, across models, GPU counts and memory sizes.

FlexSP's plan of short documents (rounds of single-GPU groups, model states sharded ZeRO-3 style)
is an EPP plan at pp 1 x sp = world, sharded over SP, with elastic SP rounds and gradients reduced
per unit.  The verdict checks that EPP is never behind it on its held-out batches (13B, 8 GPUs of
80 GiB); this sweep checks the same layout on other models, 4 and 8 GPUs, and 80 and 48 GiB GPUs,
on two short-document batches, with the shipped default profile.  Each row records both steps,
their round counts and EPP's planning time; the file records the worst ratio.

    python -m benchmarks.planner.flexsp_space             # writes benchmarks/results/planner_flexsp_space.json
    python -m benchmarks.planner.flexsp_space --quick     # two settings (a smoke run)
    python -m benchmarks.planner.flexsp_space --search    # the full layout search instead (run "search")

``--search`` runs the layout search itself (``search_layouts``, as ``--search-layout`` does) on the
same models, GPU counts and sizes, on a short-only, a SlimPajama-like and a ProLong-like batch (up
to 64K tokens), and records the pick and its ``over_alternatives`` minimum: whether what users are
told holds beyond the verdict's 13B on 8 GPUs.

``--label NAME`` stores the run under that name in the file's ``runs`` (e.g. ``before`` with another
checkout first on ``PYTHONPATH``), so two versions sit side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.config import planning_budget
from infinipipe_hf.data import synthetic
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.result import NoLayoutFits
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step

OUT = RESULTS / "planner_flexsp_space.json"
MODELS = ("llama2-7b", "llama3.1-8b", "qwen2.5-7b", "llama2-13b")
WORLDS = (4, 8)
GPU_GIB = (80.0, 48.0)


def batches() -> dict[str, list[int]]:
    """Two short-document batches, seeds the verdict and the planner tables do not use."""
    return {"short-only 512 x 2K": synthetic.short_only(n=512, max_len=2048, seed=2),
            "short-only 256 x 4K": synthetic.short_only(n=256, max_len=4096, seed=3)}


def row(model: str, world: int, gpu_gib: float, name: str, lengths: list[int]) -> dict:
    """EPP at pp 1 x sp ``world`` (shard sp, per-unit reduction) and FlexSP on the same budget."""
    spec = ModelSpec.from_json_file(config_path(model))
    budget = planning_budget(gpu_gib * GIB, 0.08, 2.0).budget_bytes
    out = {"model": model, "world_size": world, "gpu_memory_gib": gpu_gib, "batch": name,
           "tokens": sum(lengths), "memory_budget_bytes": budget}
    cost = CostModel(spec, default_profile(), ParallelDims(1, world, 1, "sp", 8), memory_budget_bytes=budget,
                     grad_reduce="unit")
    t0 = time.perf_counter()
    try:
        epp = plan_step(lengths, spec, options=PlanOptions(grad_reduce="unit"), cost=cost)
    except ValueError as exc:
        return {**out, "error": str(exc)}
    out["epp_planning_time_s"] = time.perf_counter() - t0
    flexsp = plan_alternative(lengths, spec, "flexsp", world_size=world, gpus_per_node=8, memory_budget_bytes=budget)
    out["epp_feasible"], out["flexsp_feasible"] = epp.feasible, flexsp.feasible
    if epp.feasible and flexsp.feasible:
        out.update(epp_step_s=epp.simulation.step_time_s, flexsp_step_s=flexsp.simulation.step_time_s,
                   epp_rounds=len(epp.plan.rounds), flexsp_rounds=len(flexsp.plan.rounds),
                   flexsp_checkpoint_layers=flexsp.plan.checkpoint_layers,
                   epp_over_flexsp=flexsp.simulation.step_time_s / epp.simulation.step_time_s)
    return out


def search_batches() -> dict[str, list[int]]:
    """Three batch kinds for the layout search, small enough for many searches (seed 5)."""
    return {"short-only 256 x 2K": synthetic.short_only(n=256, max_len=2048, seed=5),
            "slimpajama-like 128 x 64K": synthetic.slimpajama_like(n=128, max_len=65536, seed=5),
            "prolong-like 128 x 64K": synthetic.prolong_like(n=128, max_len=65536, seed=5)}


def search_row(model: str, world: int, gpu_gib: float, name: str, lengths: list[int]) -> dict:
    """The layout search's pick and its lead over each alternative at its best."""
    spec = ModelSpec.from_json_file(config_path(model))
    budget = planning_budget(gpu_gib * GIB, 0.08, 2.0).budget_bytes
    out = {"model": model, "world_size": world, "gpu_memory_gib": gpu_gib, "batch": name}
    t0 = time.perf_counter()
    try:
        found = search_layouts(lengths, spec, world_size=world, gpus_per_node=8, memory_budget_bytes=budget)
    except NoLayoutFits as exc:
        return {**out, "error": str(exc).split(";")[0]}
    rec = found.to_dict()["recommended"]
    over = rec.get("over_alternatives", {})
    pick = f"pp {rec['pp_degree']} x sp {rec['sp_degree']} x dp {rec['dp_degree']}"
    out.update(search_time_s=time.perf_counter() - t0, pick=pick, shard=rec["shard"],
               tokens_per_s=rec["tokens_per_s"], over_alternatives=over,
               adopt_rounds_of=rec["training_arguments"].get("adopt_rounds_of", []))
    if over:
        out["min_alternative"], out["min_over_alternatives"] = min(over.items(), key=lambda kv: kv[1])
    return out


def _said(r: dict) -> str:
    """One row's line of the run's log."""
    if "min_over_alternatives" in r:
        adopted = f" (adopting {', '.join(r['adopt_rounds_of'])})" if r.get("adopt_rounds_of") else ""
        return f"{r['pick']} shard {r['shard']}, {r['min_over_alternatives']:.4f}x {r['min_alternative']}{adopted}"
    if "epp_over_flexsp" in r:
        return f"{r['epp_over_flexsp']:.4f}x FlexSP ({r['epp_rounds']} / {r['flexsp_rounds']} rounds)"
    return r.get("error", "nothing to compare (no alternative fits, or EPP or FlexSP does not)")


def sweep(quick: bool, search: bool) -> dict:
    """Every (model, GPUs, GPU size, batch) row: FlexSP in EPP's space, or the layout search's pick."""
    load = os.getloadavg()
    settings = [(m, w, g) for m in MODELS for w in WORLDS for g in GPU_GIB][:1 if quick else None]
    named = list((search_batches() if search else batches()).items())[:1 if quick else None]
    make, key = (search_row, "min_over_alternatives") if search else (row, "epp_over_flexsp")
    rows = []
    for model, world, gib in settings:
        for name, lengths in named:
            rows.append(make(model, world, gib, name, lengths))
            print(f"{model:12s} {world} GPUs {gib:4.0f} GiB  {name}: {_said(rows[-1])}", flush=True)
    compared = [r for r in rows if key in r]
    times = [r[t] for r in rows for t in ("search_time_s", "epp_planning_time_s") if t in r]
    return {"rows": rows, "compared": len(compared), "below_1": sum(r[key] < 1 - 1e-9 for r in compared),
            "adopted": sum(bool(r.get("adopt_rounds_of")) for r in rows),
            "worst": min(compared, key=lambda r: r[key]) if compared else None,
            "max_search_time_s" if search else "max_planning_time_s": max(times, default=0.0),
            "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
            "note": "simulated steps (cost model, shipped default profile); search and planning times measured here"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one setting and one batch")
    ap.add_argument("--search", action="store_true", help="the full layout search against every alternative")
    ap.add_argument("--label", default=None, help="the run's name in the file's runs (default: current, or search)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    result = sweep(args.quick, args.search)
    args.label = args.label or ("search" if args.search else "current")
    out = Path(args.out)
    runs = json.loads(out.read_text()).get("runs", {}) if out.exists() else {}
    runs[args.label] = result
    out.write_text(json.dumps({"runs": runs}, indent=1))
    worst = result["worst"]
    keys = ("model", "world_size", "gpu_memory_gib", "batch", "min_over_alternatives" if args.search else "epp_over_flexsp")
    print(json.dumps({"compared": result["compared"], "below_1": result["below_1"],
                      "worst": worst and {k: worst[k] for k in keys}}))


if __name__ == "__main__":
    main()
