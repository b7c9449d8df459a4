"""Simulator vs real CPU runs that slice, pack and checkpoint: every schedule, pp 2, pp 4, pp 2 x sp 2
(with and without elastic SP rounds).

    python -m benchmarks.cpu.sim_vs_real [--repeats 3] [--out benchmarks/results/sim_vs_real.json] [--quick]

1. Profile: ``cpu_profile.fit_cpu_profile`` fits the cost model to separate measurements of the
   pieces of an action (layer forward/backward on whole, context-carrying and packed units, every
   checkpoint level, the chunked loss, the embedding, gloo point-to-point), per-thread CPU seconds
   through the runtime's code, and checks it on held-out shapes; the point-to-point probe also
   counts the CPU a message costs both ends (gloo's threads).  The ranks of a run share the cores
   this process may use and the simulator replays with processor sharing
   (``benchmarks/lib/shared_cores.py``); each rank is pinned to one core (rank r on core r % cores,
   ``--no-pin`` to let the kernel place them) and the setting says so (``pinned_ranks``, saved
   beside the profile's fields), so the replay shares each core among its own ranks only.
2. Budgets: for each layout and schedule, the smallest memory budget at which the planner finds a
   plan (bisection on ``plan_step``), times ``--budget-slack``: every schedule runs near its memory
   limit, so EPP slices, packs and checkpoints, and the baselines checkpoint.
3. Runs: for each repeat and layout, wait until the machine's 1-minute load is below ``--max-load``
   (polling up to ``--max-wait-s``; the load is recorded either way), then one torchrun launch
   (``benchmarks/workers/runtime_worker.py``, one thread per rank, gloo) runs every schedule: a warm-up step that
   plans, ``--steps`` timed steps of that plan (8: the median over them outlasts a speed burst of
   a few steps), and one step under the allocator-event memory probe.
   Every rank times the speed-probe shapes before each timed step and after the last
   (``--probe-once``: only before the first and after the last).
4. Comparison (``sim_compare.py``): each timed step against the simulation with the profile
   rescaled to the machine's speed of the two probes around that step, and the median over the
   steps (this VM's speed moves by +-15% within a minute: a probe minutes away, or one factor for
   all steps, turns that into model error; the comparison with one factor pooled over all probes
   and the median step is reported beside it), the per-(stage, F/B) breakdown and the
   measured-work replay that split the difference between the cost model and the machine model,
   and each stage's simulated vs measured peak memory.

The goal (issue 12): within 10% at pp 2 and pp 4 in every repeat, 20% at pp 2 x sp 2 (issue 10),
memory within 10%.  The JSON reports every repeat, the worst case and the spread, with load and
versions.  CPU figures say how far the model is on this machine, not on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cpu.cpu_profile import (
    LOSS_CHUNK_TOKENS,
    MODEL,
    SPEED_PROBE_SHAPES,
    load_or_fit,
    machine,
    spec_of,
    wait_for_low_load,
)
from benchmarks.cpu.sim_compare import compare_run
from benchmarks.lib.launch import torchrun
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.shared_cores import SharedCores, with_shared_cores
from infinipipe_hf.layout import ParallelDims

LENGTHS = [2048, 1024, 700, 420, 300, 260, 180, 120, 90, 64, 40]
SCHEDULES = ["epp", "packed-1f1b", "seq1f1b", "gpipe"]
LAYOUTS = {"pp2": (2, 1), "pp4": (4, 1), "pp2xsp2": (2, 2), "pp2xsp2_rounds": (2, 2), "pp2xsp2_whole": (2, 2)}
TOLERANCE = {"pp2": 0.10, "pp4": 0.10, "pp2xsp2": 0.20, "pp2xsp2_rounds": 0.20, "pp2xsp2_whole": 0.20}
ROUND_LENGTHS = [1024, 512, 300, 260, 180, 120, 90, 64, 40, 40, 32, 30]
"""A long tail of short sequences: with elastic SP rounds the planner runs them on one rank each."""
OPTIONS = {"pp2xsp2_rounds": {"lengths": ROUND_LENGTHS, "sp_rounds": True, "budget_slack": 1.5},
           "pp2xsp2_whole": {"lengths": ROUND_LENGTHS, "sp_rounds": False, "budget_slack": 1.5}}
"""Per layout: its batch (default ``LENGTHS``), ``sp_rounds`` (default: the planner's choice) and
budget slack (default ``--budget-slack``).  A single-rank unit keeps its whole activations on one
rank, so near the smallest budget the planner keeps every unit on the whole group: the rounds
layout gets 1.5x.  ``pp2xsp2_whole`` runs the same batch and slack with every unit on the whole SP
group, for comparison."""


def lengths_of(layout: str) -> list[int]:
    return OPTIONS.get(layout, {}).get("lengths", LENGTHS)


def rounds_of(layout: str) -> bool | None:
    return OPTIONS.get(layout, {}).get("sp_rounds")


def round_summary(plan_dict: dict) -> dict:
    """How a plan uses SP sub-groups: rounds, units per sub-group size."""
    from infinipipe_hf.ir.plan import Plan

    plan = Plan.from_dict(plan_dict)
    sizes = [plan.sub_group(u.id).size for u in plan.units]
    return {"rounds": len(plan.rounds), "units_per_group_size": {str(g): sizes.count(g) for g in sorted(set(sizes))}}
MEMORY_TOLERANCE = 0.10


def layers_per_stage(pp: int) -> list[int]:
    """The engine's split (``PipelineEngine``: ``partition_layers`` with the LM head as extra)."""
    from infinipipe_hf.ir.partition import partition_layers

    spec = spec_of(MODEL)
    return [len(r) for r in partition_layers(spec.num_layers, pp,
                                             last_stage_extra=spec.embedding_params / spec.layer_params)]


def cost_for(profile, pp: int, sp: int, budget_bytes: float | None = None, shared: SharedCores | None = None):
    """The cost model of the benchmark's engine at ``pp`` x ``sp``, its ranks on ``shared`` cores."""
    from infinipipe_hf.planner.cost.model import CostModel

    return with_shared_cores(CostModel(spec_of(MODEL), profile, ParallelDims(pp_degree=pp, sp_degree=sp),
                                       layers_per_stage=layers_per_stage(pp), memory_budget_bytes=budget_bytes,
                                       loss_chunk_tokens=LOSS_CHUNK_TOKENS), shared)


def tight_budget(profile, pp: int, sp: int, schedule: str, slack: float, iterations: int = 8,
                 lengths: list[int] = LENGTHS, sp_rounds: bool | None = None,
                 shared: SharedCores | None = None) -> tuple[float, dict]:
    """``slack`` x the smallest budget (bytes) at which ``plan_step`` finds a plan, and that plan's
    summary at the returned budget."""
    from infinipipe_hf.planner.search.api import PlanOptions, plan_step

    knobs = {"sp_rounds": sp_rounds} if sp_rounds is not None and schedule == "epp" else {}
    options = PlanOptions(schedule=schedule, **knobs)

    def feasible(b):
        return plan_step(lengths, spec_of(MODEL), None, options, cost=cost_for(profile, pp, sp, b, shared)).feasible

    cost = cost_for(profile, pp, sp)
    lo = max(cost.acts.static_bytes(s) for s in range(pp))
    hi = 2 * lo
    while not feasible(hi):
        lo, hi = hi, 2 * hi
        if hi > 2**40:
            raise RuntimeError(f"{schedule} at pp {pp} x sp {sp}: no feasible plan below 1 TiB")
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    budget = hi * slack
    res = plan_step(lengths, spec_of(MODEL), None, options, cost=cost_for(profile, pp, sp, budget, shared))
    return budget, {"min_feasible_bytes": hi, "budget_bytes": budget, "units": len(res.plan.units),
                    "checkpointed_layers": sum(sum(v.values()) for v in res.plan.checkpoint_layers.values())}


def step_costs(run: dict, profile, pp: int, sp: int, budget_bytes: float,
               shared: SharedCores | None = None) -> list | None:
    """One cost model per timed step, at the speed factor of the two probes around it (the rows of
    probe k, just before step k, and of probe k + 1); None unless the run probed every step."""
    from benchmarks.lib.runtime_fit import rescale_compute, speed_factor

    probes = run.get("speed_probes") or []
    if not run.get("speed_probe_every_step") or len(probes) != len(run["step_span_s"]) + 1:
        return None
    spec = spec_of(MODEL)
    # A probe holds every rank's rows; a step's factor uses the rows of the probes on both sides.
    rows = [[row for rank_rows in probe for row in rank_rows] for probe in probes]
    factors = [speed_factor(profile, spec, before + after) for before, after in zip(rows, rows[1:])]
    return [cost_for(rescale_compute(profile, f), pp, sp, budget_bytes, shared) for f in factors]


def launch(spec: dict, nproc: int, timeout_s: float) -> dict:
    """Run ``benchmarks.workers.runtime_worker`` on ``nproc`` gloo ranks; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=str(Path(tmp) / "out.json"))
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        p = torchrun(["-m", "benchmarks.workers.runtime_worker", spec_path], nproc, timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"runtime_worker failed (exit {p.returncode}):\n{p.stdout[-4000:]}")
        print("\n".join(line for line in p.stdout.splitlines() if line.startswith("[rank 0]")), file=sys.stderr)
        return json.loads(Path(spec["out"]).read_text())


def summarise(repeats: list[dict]) -> dict:
    out = {}
    for layout in LAYOUTS:
        for schedule in SCHEDULES:
            rows = [r["layouts"][layout][schedule] for r in repeats
                    if layout in r["layouts"] and "relative_difference" in r["layouts"][layout].get(schedule, {})]
            if not rows:
                continue
            rel = [x["relative_difference"] for x in rows]
            mem = [x["memory_worst_relative_difference"] for x in rows if x["memory_worst_relative_difference"] is not None]
            out[f"{layout}/{schedule}"] = {
                "relative_differences": rel, "worst": max(rel, key=abs), "spread": max(rel) - min(rel),
                "within_tolerance_every_repeat": all(abs(x) <= TOLERANCE[layout] for x in rel),
                "machine_model_errors": [x["machine_model_error"] for x in rows],
                "cost_model_errors": [x["cost_model_error"] for x in rows],
                "speed_factors": [x.get("speed_factor") for x in rows],
                "pooled_relative_differences": [x.get("pooled_relative_difference", x["relative_difference"])
                                                for x in rows],
                "per_step_relative_differences": [[st["relative_difference"] for st in x["per_step"]]
                                                  if x.get("per_step") else None for x in rows],
                "uncalibrated_relative_differences": [x.get("uncalibrated_relative_difference") for x in rows],
                "memory_worst": max(mem, key=abs) if mem else None,
                "memory_within_tolerance_every_repeat": all(abs(x) <= MEMORY_TOLERANCE for x in mem) if mem else None}
    every = [v for v in out.values()]
    return {"per_case": out,
            "worst_time": max((v["worst"] for v in every), key=abs, default=None),
            "worst_memory": max((v["memory_worst"] for v in every if v["memory_worst"] is not None), key=abs, default=None),
            "cases_within_time_tolerance": sum(v["within_tolerance_every_repeat"] for v in every),
            "cases_within_memory_tolerance": sum(bool(v["memory_within_tolerance_every_repeat"]) for v in every),
            "cases": len(every)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "sim_vs_real.json"))
    ap.add_argument("--quick", action="store_true", help="quick profile, one repeat, pp 2 only, one timed step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--probe-once", action="store_true",
                    help="probe the machine's speed only before and after a schedule's timed steps, not before each")
    ap.add_argument("--no-pin", action="store_true",
                    help="let the OS place the ranks on the cores (default: rank r pinned to core r %% cores, "
                         "and the simulator shares each core among its own ranks)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--budget-slack", type=float, default=1.1)
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--max-wait-s", type=float, default=600)
    ap.add_argument("--profile-report", help="reuse a benchmarks.cpu.cpu_profile report (JSON) instead of fitting anew")
    ap.add_argument("--profile", help="reuse a saved HardwareProfile (e.g. results/sim_vs_real.profile.json)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--render", action="store_true", help="do not run: rewrite the markdown of --out from its data")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.out).read_text())
        result["markdown"] = markdown(result)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(result["markdown"])
        return 0
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    t0 = time.time()
    layouts = ["pp2"] if args.quick else args.layouts.split(",")
    schedules = args.schedules.split(",")
    repeats, steps = (1, 1) if args.quick else (args.repeats, args.steps)
    from benchmarks.lib.runtime_fit import rescale_compute, speed_factor
    from benchmarks.lib.shared_cores import save_profile

    profile, shared, report = load_or_fit(args.profile, args.profile_report, quick=args.quick, pinned=not args.no_pin,
                                          max_load=args.max_load, max_wait_s=args.max_wait_s, log=log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = out.with_name(out.stem + ".profile.json")
    save_profile(profile_path, profile, shared)
    budgets = {}
    for layout in layouts:
        pp, sp = LAYOUTS[layout]
        slack = OPTIONS.get(layout, {}).get("budget_slack", args.budget_slack)
        budgets[layout] = {s: tight_budget(profile, pp, sp, s, slack, 5 if args.quick else 8,
                                           lengths_of(layout), rounds_of(layout), shared) for s in schedules}
        log(f"  {layout} budgets: " + ", ".join(f"{s} {b[0] / 2**20:.0f} MiB ({b[1]['units']} units, "
                                                 f"{b[1]['checkpointed_layers']} ckpt)" for s, b in budgets[layout].items()))
    runs = []

    def write(runs_so_far, final: bool = False):
        result = {
            "what": "simulated vs measured step time and peak memory of real CPU runs (gloo, 1 thread per rank)",
            "complete": final, "machine": machine(), "model": MODEL, "lengths": LENGTHS,
            "loss_chunk_tokens": LOSS_CHUNK_TOKENS,
            "layouts": {k: {"pp_degree": LAYOUTS[k][0], "sp_degree": LAYOUTS[k][1], **OPTIONS.get(k, {})}
                        for k in layouts},
            "tolerance": {"time": TOLERANCE, "memory": MEMORY_TOLERANCE},
            "budgets": budgets, "budget_slack": args.budget_slack, "max_load": args.max_load,
            "pinned_ranks": not args.no_pin,
            "profile": {"path": profile_path.name, **{k: report.get(k) for k in (
                "fit_worst_relative_error", "held_out_worst_relative_error", "fit_worst_row", "held_out_worst_row",
                "fit_worst_relative_error_over_1ms", "held_out_worst_relative_error_over_1ms", "fit_errors",
                "held_out_errors", "load_before",
                "load_after", "elapsed_s", "repeat", "p2p_rows")},
                "coefficients": {**{k: v for k, v in dataclasses.asdict(profile).items() if k != "meta"},
                                 **SharedCores.fields(shared)}},
            "summary": summarise(runs_so_far), "repeats": runs_so_far, "elapsed_s": time.time() - t0,
            "command": " ".join(["python -m benchmarks.cpu.sim_vs_real", *(argv if argv is not None else sys.argv[1:])]),
        }
        result["markdown"] = markdown(result)
        out.write_text(json.dumps(result, indent=1))
        return result

    for rep in range(repeats):
        record = {"repeat": rep, "layouts": {}, "load": {}}
        for layout in layouts:
            pp, sp = LAYOUTS[layout]
            load = wait_for_low_load(args.max_load, args.max_wait_s, log)
            spec = {"model": MODEL, "lengths": lengths_of(layout), "schedules": schedules, "pp_degree": pp,
                    "sp_degree": sp, "sp_rounds": rounds_of(layout),
                    "profile": str(profile_path), "loss_chunk_tokens": LOSS_CHUNK_TOKENS, "memory_probe": True,
                    "memory_budget_gib": {s: b[0] / 2**30 for s, b in budgets[layout].items()},
                    "warmup": 1, "steps": steps, "seed": 0, "speed_probe_every_step": not args.probe_once,
                    "pin_cores": not args.no_pin,
                    "speed_probe": [[list(map(list, segs)), level] for segs, level in SPEED_PROBE_SHAPES]}
            t1 = time.time()
            raw = launch(spec, pp * sp, args.timeout)
            load["load_at_end"] = list(os.getloadavg())
            load["run_s"] = time.time() - t1
            record["load"][layout] = load
            cost_budgets = {s: b[0] for s, b in budgets[layout].items()}
            res = {}
            for s in schedules:
                r = raw.get(s, {"error": "not run"})
                if "error" in r:
                    res[s] = r
                    continue
                uncalibrated = cost_for(profile, pp, sp, cost_budgets[s], shared)
                factor = speed_factor(profile, spec_of(MODEL), [row for rows in r["speed_probe"] for row in rows])
                res[s] = compare_run(r, cost_for(rescale_compute(profile, factor), pp, sp, cost_budgets[s], shared),
                                     tol=TOLERANCE[layout], uncalibrated=uncalibrated,
                                     step_costs=step_costs(r, profile, pp, sp, cost_budgets[s], shared))
                res[s]["sp_rounds"] = round_summary(r["plan"])
                if rounds_of(layout) and not res[s]["sp_rounds"]["rounds"]:
                    log(f"  {layout} {s}: the planner chose no SP rounds at this budget")
                log(f"  repeat {rep} {layout} {s} (speed x{factor:.3f}): simulated {res[s]['simulated_step_s']:.3f} s, measured "
                    f"{res[s]['measured_step_s']:.3f} s ({res[s]['relative_difference']:+.1%}, pooled factor "
                    f"{res[s]['pooled_relative_difference']:+.1%}, uncalibrated "
                    f"{res[s]['uncalibrated_relative_difference']:+.1%}; machine model "
                    f"{res[s]['machine_model_error']:+.1%}, cost model {res[s]['cost_model_error']:+.1%}); "
                    f"memory worst {res[s]['memory_worst_relative_difference']:+.1%}; load {load['load_at_start'][0]:.2f}")
            record["layouts"][layout] = res
            write(runs + [record])
        runs.append(record)
    result = write(runs, final=True)
    s = result["summary"]
    print(f"worst step-time difference {s['worst_time']:+.1%}, worst memory difference "
          f"{(s['worst_memory'] or 0):+.1%}; {s['cases_within_time_tolerance']}/{s['cases']} cases within the time "
          f"tolerance in every repeat; {time.time() - t0:.0f} s; wrote {out}")
    return 0


def markdown(result: dict) -> str:
    """Per layout and schedule: (simulated - measured) / measured step time in every repeat (the
    median over timed steps of each step against the profile rescaled by the probes around it;
    with one factor pooled over all probes, and the profile as fitted, beside it), its split into machine
    model and cost model, and the worst signed memory difference (negative: under-estimate)."""
    rows = ["| layout | schedule | step time: sim vs measured, each repeat | worst | one pooled speed factor "
            "| profile as fitted (speed factor) "
            "| machine model / cost model (worst repeat) | peak memory: sim vs measured, worst stage and repeat |",
            "|---|---|---|---|---|---|---|---|"]
    for key, case in result["summary"]["per_case"].items():
        layout, schedule = key.split("/")
        diffs = case["relative_differences"]
        i = max(range(len(diffs)), key=lambda j: abs(diffs[j]))
        mem = case.get("memory_worst")
        raw = ", ".join(f"{u:+.0%} (x{f:.2f})" for u, f in zip(case.get("uncalibrated_relative_differences") or [],
                                                              case.get("speed_factors") or []) if u is not None)
        pooled = ", ".join(f"{d:+.1%}" for d in case.get("pooled_relative_differences") or [])
        rows.append(f"| {layout} | {schedule} | {', '.join(f'{d:+.1%}' for d in diffs)} | {diffs[i]:+.1%} | "
                    f"{pooled or '-'} | {raw or '-'} | {case['machine_model_errors'][i]:+.1%} / {case['cost_model_errors'][i]:+.1%} | "
                    f"{'-' if mem is None else f'{mem:+.1%}'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
