"""Interleaved A/B of real CPU runs at equal memory: EPP against seq1f1b and packed-1f1b.

    python -m benchmarks.cpu.ab_runtime [--pp 2] [--alternations 7]

The batch and model are ``runtime_cpu_bench.py``'s (the long-tailed stdlib batch, the small float32
Llama), every schedule planned under the *same* memory budget and the same CPU profile, fitted on
this machine first through the runtime's own code path (``cpu_profile.fit_cpu_profile``: whole
sequences, slices with context and packs; saved beside ``--out``), each engine planned once and
each rank pinned to one core as the profile file says (``pinned_ranks``, beside ``shared_cores``:
``benchmarks/lib/shared_cores.py``); then the schedules alternate
step by step (``benchmarks/workers/ab_worker.py``), so a slow phase of the shared machine lands on each of them.  Reported per pair: the measured EPP / baseline throughput
ratio of each alternation, its median and spread (min, max), beside the simulated ratio of the same
plans, and every action's measured CPU seconds against the cost model's, per action class (whole
sequence, pack, first slice, context slice, hybrid; forward, backward with and without
recompute).  CPU numbers check the runtime's real advantage against the simulator's; they say little
about GPUs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.cpu.cpu_profile import LOSS_CHUNK_TOKENS, MODEL, fit_cpu_profile
from benchmarks.cpu.runtime_cpu_bench import memory_budget_gib, stdlib_batch
from benchmarks.lib.launch import torchrun
from benchmarks.lib.paths import RESULTS
from infinipipe_hf.layout import ParallelDims

SCHEDULES = ["epp", "seq1f1b", "packed-1f1b"]


def pair(runs: dict, base: str) -> dict:
    e, b = runs["epp"], runs[base]
    per = [tb / te for te, tb in zip(e["step_s"], b["step_s"])]  # tokens/s ratio = time ratio inverted
    return {"measured_ratios": per, "measured_median": statistics.median(per), "measured_min": min(per),
            "measured_max": max(per), "simulated_ratio": b["simulated_step_s"] / e["simulated_step_s"],
            "median_minus_simulated_points": 100 * (statistics.median(per) - b["simulated_step_s"] / e["simulated_step_s"])}


def unit_class(unit, lengths) -> str:
    """whole (one whole sequence), pack (several), first slice, context slice, hybrid."""
    kind = unit.kind(lengths).value
    if kind == "packed":
        return "whole" if len(unit.segments) == 1 else "pack"
    if kind == "slice":
        return "first slice" if unit.segments[0].start == 0 else "context slice"
    return kind


def breakdown(run: dict, profile, budget_gib: float, lengths: list[int]) -> dict:
    """Measured CPU seconds of each action against the cost model's, summed per action class
    (unit class, F/B, checkpointing): ``measured_over_predicted`` and the action count."""
    from infinipipe_hf.ir.actions import Action
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.ir.plan import Plan
    from infinipipe_hf.planner.cost.model import GIB, CostModel
    from infinipipe_hf.planner.simulate.action_costs import ActionCosts

    plan = Plan.from_dict(run["plan"])
    spec = ModelSpec.from_config_dict({"model_type": "llama", **MODEL})
    cost = CostModel(spec, profile, ParallelDims(pp_degree=plan.pp_degree), layers_per_stage=plan.layers_per_stage or None, memory_budget_bytes=budget_gib * GIB)
    costs, units = ActionCosts(plan, cost), {u.id: u for u in plan.units}
    groups: dict[str, list[float]] = {}
    for events in run["events"]:
        for stage, text, cpu_s, _wall, _wait in events:
            a = Action.parse(text)
            level = ("recompute" if plan.checkpointed(stage, a.unit) or plan.checkpoint_levels.get(stage, {}).get(a.unit)
                     else "no recompute") if not a.is_forward else "forward"
            key = f"{unit_class(units[a.unit], lengths)} / {a.kind} / {level}"
            g = groups.setdefault(key, [0.0, 0.0, 0])
            g[0] += cpu_s
            g[1] += costs.unit_duration(stage, a)
            g[2] += 1
    return {k: {"measured_over_predicted": m / p if p else None, "actions": n, "measured_cpu_s": m,
                "predicted_s": p} for k, (m, p, n) in sorted(groups.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--alternations", type=int, default=7)
    ap.add_argument("--profile", default=None,
                    help="a saved CPU profile of this model (default: fit one now, quick, saved beside --out)")
    ap.add_argument("--out", default=str(RESULTS / "ab_runtime.json"))
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--reanalyse", action="store_true", help="analyse the kept raw runs of --out again, no run")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="one memory budget for every schedule (default: runtime_cpu_bench's, where packed-1f1b "
                         "does not fit)")
    args = ap.parse_args(argv)
    if args.alternations < 5:
        raise SystemExit(f"--alternations must be at least 5 for a median and a spread, got {args.alternations}")
    from benchmarks.cpu.cpu_profile import machine_sharing
    from benchmarks.lib.shared_cores import load_profile, save_profile

    t0 = time.time()
    lengths = stdlib_batch()
    raw = Path(args.out).with_suffix(".raw.json")
    profile_path, fit = Path(args.profile or Path(args.out).with_suffix(".profile.json")), None
    if args.profile is None and not args.reanalyse:
        profile, report = fit_cpu_profile(quick=True, log=lambda m: print(m, file=sys.stderr))
        save_profile(profile_path, profile, machine_sharing(pinned=True))
        fit = {k: report[k] for k in ("fit_worst_relative_error", "held_out_worst_relative_error", "fit_worst_row",
                                      "fit_worst_relative_error_over_1ms", "held_out_worst_relative_error_over_1ms",
                                      "fit_errors", "held_out_errors", "load_before", "repeat")}
    profile, _ = load_profile(profile_path)  # the workers plan on the file's shared cores
    budget = args.budget_gib or memory_budget_gib(profile, lengths, args.pp)
    spec = {"model": MODEL, "lengths": lengths, "schedules": SCHEDULES, "pp_degree": args.pp,
            "profile": str(profile_path), "memory_budget_gib": budget, "alternations": args.alternations,
            "seed": 0, "loss_chunk_tokens": LOSS_CHUNK_TOKENS, "pin_cores": True}
    if args.reanalyse:
        runs = json.loads(raw.read_text())
        if Path(args.out).exists():  # the profile fit was reported by the run itself; keep it
            fit = json.loads(Path(args.out).read_text()).get("profile_fit")
    else:
        runs = launch_ab(spec, args.pp, args.timeout)
        raw.write_text(json.dumps(runs))  # kept, so the analysis can be redone (--reanalyse)
    ok = [s for s in SCHEDULES if "error" not in runs.get(s, {"error": "not run"})]
    result = {"machine": f"CPU, {__import__('os').cpu_count()} cores shared with other jobs, gloo, pp={args.pp}, "
                         f"1 thread per rank pinned to a core, float32", "profile": str(profile_path), "profile_fit": fit,
              "memory_budget_gib": budget,
              "model": MODEL, "lengths": lengths, "runs": runs,
              "pairs": {b: pair(runs, b) for b in ok if b != "epp" and "epp" in ok},
              "per_action_class": {s: breakdown(runs[s], profile, budget, lengths) for s in ok},
              "elapsed_s": time.time() - t0}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for b, p in result["pairs"].items():
        print(f"EPP / {b}: measured median {p['measured_median']:.3f} (min {p['measured_min']:.3f}, max "
              f"{p['measured_max']:.3f}) over {len(p['measured_ratios'])} alternations; simulated "
              f"{p['simulated_ratio']:.3f}")
    for s in ok:
        for key, g in result["per_action_class"][s].items():
            print(f"  {s:12s} {key:40s} measured/predicted {g['measured_over_predicted']:.2f} ({g['actions']} actions)")
    return 0


def launch_ab(spec: dict, nproc: int, timeout_s: float) -> dict:
    """Run ``benchmarks.workers.ab_worker`` on ``nproc`` gloo ranks; rank 0's JSON."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=str(Path(tmp) / "out.json"))
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        p = torchrun(["-m", "benchmarks.workers.ab_worker", spec_path], nproc, timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"ab_worker failed (exit {p.returncode}):\n{p.stdout[-4000:]}")
        print("\n".join(line for line in p.stdout.splitlines() if line.startswith("[rank 0]")), file=sys.stderr)
        return json.loads(Path(spec["out"]).read_text())


if __name__ == "__main__":
    sys.exit(main())
