"""Published measurements against the cost model, before and after calibration.

Every published setting that maps onto the planner is planned by our model of the system that was
measured (torchtitan FSDP = ``ulysses-zero3`` at SP 1; torchtitan FSDP + CP = ``ring-cp``; Seq1F1B =
our ``seq1f1b`` pipeline schedule), with the hardware and precision differences converted by stated
factors (``FACTORS``), and compared with the published number.  The calibration
(:class:`~infinipipe_hf.planner.cost.calibration.Calibration`) is fitted on the rows marked ``fit`` and
checked on the ``held_out`` ones.  Whole-step efficiency is fitted per system: torchtitan's on its FSDP
rows (priced for ``ulysses-zero3`` and ``ring-cp``), Megatron's on the Seq1F1B 64K row (``ring-cp-packed``),
EPP's on our own GPU runs (``calibration_rows.own_runs``); the collective and ring mechanisms are shared.
The shipped default profile is written from the fit.

    python -m benchmarks.planner.calibration            # writes benchmarks/results/calibration.json
    python -m benchmarks.planner.calibration --no-seq1f1b   # skip the (slower) pipeline rows
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from benchmarks.lib.paths import REPO, RESULTS
from benchmarks.planner.calibration_rows import (
    FACTORS,
    NOT_COMPARABLE,
    ROWS,
    epp_efficiency,
    hardware,
    megatron_flops_per_token,
    own_run_rows,
    spec_of,
    workload,
)
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.calibration import Calibration, apply_calibration
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.cost.profile import HardwareProfile, uncalibrated_profile
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step

OUT = RESULTS / "calibration.json"
PROFILE_OUT = REPO / "infinipipe_hf" / "profiles" / "h100_bf16_calibrated.json"
PARAMS = ("compute_efficiency", "collective_overlap", "ring_step_efficiency", "ring_merge_bytes_per_token",
          "compile_speedup", "fp8_linear", "megatron_efficiency", "epp_efficiency")
"""``compute_efficiency`` is torchtitan's (eager) whole-step efficiency; Megatron's and EPP's have their own."""
IDEAL = {"compute_efficiency": 1.0, "collective_overlap": 1.0, "ring_step_efficiency": 1.0,
         "ring_merge_bytes_per_token": 0.0, "compile_speedup": 1.0, "fp8_linear": 1.0,
         "megatron_efficiency": 1.0, "epp_efficiency": 1.0}
BOUNDS = {"compute_efficiency": (0.3, 1.2), "collective_overlap": (0.0, 1.0), "ring_step_efficiency": (0.2, 1.0),
          "ring_merge_bytes_per_token": (0.0, 4e6), "compile_speedup": (1.0, 2.0), "fp8_linear": (1.0, 2.5)}
SYSTEMS = {"ulysses-zero3": "torchtitan FSDP rows (eager; ZeRO-3 steps assumed alike)",
           "ring-cp": "torchtitan FSDP rows (eager; its CP rows fit the ring's step cost)",
           "ring-cp-packed": "Seq1F1B (Megatron) 64K row, times its fused-kernel factor (compile_speedup)"}
"""Alternatives with a measured whole-step efficiency, and where it comes from; the others get EPP's."""


def system_efficiencies(params: dict) -> dict[str, float]:
    tt, meg = params["compute_efficiency"], params["megatron_efficiency"] * params["compile_speedup"]
    return {"ulysses-zero3": tt, "ring-cp": tt, "ring-cp-packed": meg}


def calibration_of(params: dict) -> Calibration:
    """The shipped calibration: EPP's efficiency baked in, the measured alternatives' beside it."""
    ideal = params["epp_efficiency"] == 1.0 and params["compute_efficiency"] == 1.0
    return Calibration(compute_efficiency=params["epp_efficiency"],
                       collective_overlap=params["collective_overlap"],
                       ring_step_efficiency=params["ring_step_efficiency"],
                       ring_merge_bytes_per_token=params["ring_merge_bytes_per_token"],
                       system_efficiency={} if ideal else system_efficiencies(params))


def row_profile(row: dict, params: dict) -> HardwareProfile:
    """The uncalibrated profile at the row's system's efficiency, on its card, with its compile / Float8."""
    base = uncalibrated_profile()
    eff = params["megatron_efficiency"] if row["schedule"] == "seq1f1b" else params["compute_efficiency"]
    cal = Calibration(compute_efficiency=eff, collective_overlap=params["collective_overlap"],
                      ring_step_efficiency=params["ring_step_efficiency"],
                      ring_merge_bytes_per_token=params["ring_merge_bytes_per_token"])
    if not cal.is_ideal:
        base = apply_calibration(base, cal)
    return workload(hardware(base, row["hardware"]), params["compile_speedup"], params["fp8_linear"],
                    row["compiled"], row["fp8"])


def predict(row: dict, params: dict) -> dict:
    """Plan ``row`` by our model of its system; tokens/s per GPU (or TFLOP/s per GPU) and the plan."""
    profile = row_profile(row, params)
    spec = spec_of(row["model"])
    if row["schedule"] == "seq1f1b":
        n = 16
        res = plan_step([row["seq"]] * n, spec, ParallelDims(pp_degree=8, sp_degree=4), PlanOptions(schedule="seq1f1b", num_slices=[4], max_tokens_per_unit=row["seq"] // 2 - 1, profile=profile, memory_budget_bytes=80 * 1e9, solver_time_limit_s=0.25)).summary()
        tps = res["tokens_per_s"] / 32
        return {"predicted": tps * megatron_flops_per_token(spec, row["seq"]) / 1e12, "tokens_per_s_gpu": tps,
                "feasible": res["feasible"], "bubble_fraction": res["bubble_fraction"],
                "slice_balance": res.get("info", {}).get("slice_balance")}
    world = 8 if row["schedule"] == "ring-cp" else row["gpus"]
    n = world // row["gpus"] if row["schedule"] == "ring-cp" else world * row["per_group"]
    knobs = ({"cp_degrees": [row["gpus"]]} if row["schedule"] == "ring-cp"
             else {"sp_degrees": [1], "pack_tokens": [row["seq"] * row["per_group"]]})
    res = plan_alternative([row["seq"]] * n, spec, row["schedule"], world_size=world, profile=profile,
                           memory_budget_bytes=96e9, checkpointing=row["checkpoint"], **knobs).summary()
    return {"predicted": res["tokens_per_s"] / world, "feasible": res["feasible"],
            "peak_memory_gib": max(res["peak_memory_bytes"]) / GIB if res.get("peak_memory_bytes") else None}


def loss(x: np.ndarray, rows: list[dict], free: tuple[str, ...], fixed: dict) -> float:
    params = dict(fixed)
    for name, v in zip(free, x):
        lo, hi = BOUNDS[name]
        params[name] = min(max(float(v), lo), hi)
    return sum(math.log(predict(r, params)["predicted"] / r["published"]) ** 2 for r in rows)


def fit(rows: list[dict]) -> dict:
    """Least squares on log(predicted / published) over the fit rows, in stages: the FSDP rows fix
    the compute efficiency, compile and Float8 factors and the collective overlap; the CP rows
    then fix the ring's step efficiency and merge bytes; Megatron's efficiency then matches its fit row
    (predictions scale with it: a few fixed-point steps); EPP's comes from our own runs."""
    params = dict(IDEAL)
    stages = [(("compute_efficiency", "compile_speedup", "fp8_linear", "collective_overlap"),
               [r for r in rows if r["schedule"] == "ulysses-zero3"]),
              (("ring_step_efficiency", "ring_merge_bytes_per_token"), [r for r in rows if r["schedule"] == "ring-cp"])]
    start = {"compute_efficiency": 0.7, "compile_speedup": 1.15, "fp8_linear": 1.4, "collective_overlap": 0.9,
             "ring_step_efficiency": 0.9, "ring_merge_bytes_per_token": 1e5}
    scale = {k: (1e5 if k == "ring_merge_bytes_per_token" else 1.0) for k in start}
    for free, sub in stages:
        def f(z):
            return loss(np.array([zi * scale[k] for zi, k in zip(z, free)]), sub, free, params)
        z0 = [start[k] / scale[k] for k in free]
        best = minimize(f, z0, method="Nelder-Mead", options={"xatol": 1e-4, "fatol": 1e-7, "maxiter": 600})
        for k, zi in zip(free, best.x):
            lo, hi = BOUNDS[k]
            params[k] = min(max(float(zi * scale[k]), lo), hi)
    for row in [r for r in rows if r["schedule"] == "seq1f1b"][:1]:
        for _ in range(3):
            params["megatron_efficiency"] *= row["published"] / predict(row, params)["predicted"]
    params["epp_efficiency"] = epp_efficiency()
    return params


def table(params_before: dict, params_after: dict, with_pipeline: bool) -> list[dict]:
    out = []
    for row in ROWS:
        if row["schedule"] == "seq1f1b" and not with_pipeline:
            continue
        before, after = predict(row, params_before), predict(row, params_after)
        out.append({**row, "before": before, "after": after,
                    "ratio_before": before["predicted"] / row["published"],
                    "ratio_after": after["predicted"] / row["published"]})
        print(f"{row['id']:28s} {row['role']:8s} published {row['published']:9.2f}  before "
              f"{before['predicted']:9.2f} ({out[-1]['ratio_before']:.2f}x)  after {after['predicted']:9.2f} "
              f"({out[-1]['ratio_after']:.2f}x)", flush=True)
    return out


CLI_ROWS = [("tt_fsdp8_eager", "ulysses-zero3", [8192] * 16, 5762), ("tt_cp4_128k", "ring-cp", [131072] * 2, 1071)]
"""Published rows the planner CLI predicts as a user would plan them: 8 GPUs, the model, the lengths."""


def cli_check(profiles: tuple[str, ...] = ("default", "uncalibrated")) -> list[dict]:
    """``python -m infinipipe_hf.plan --schedule S --json`` on each published row, per shipped profile:
    no card conversion (our 700 W SXM profile against their 500 W part), the CLI's own knob search."""
    out = []
    model = REPO / "infinipipe_hf" / "models" / "configs" / "llama3.1-8b.json"
    with tempfile.TemporaryDirectory() as tmp:
        for rid, schedule, lengths, published in CLI_ROWS:
            path = Path(tmp) / f"{rid}.txt"
            path.write_text("\n".join(map(str, lengths)))
            for profile in profiles:
                cmd = [sys.executable, "-m", "infinipipe_hf.plan", "--model", str(model), "--lengths", str(path),
                       "--world-size", "8", "--pp", "1", "--gpu-memory-gib", "80", "--schedule", schedule,
                       "--profile", profile, "--json"]
                got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
                per_gpu = got["tokens_per_s"] / 8
                out.append({"id": rid, "schedule": schedule, "profile": profile, "published": published,
                            "predicted": per_gpu, "ratio": per_gpu / published, "info": got.get("info"),
                            "command": " ".join(cmd[1:]).replace(tmp, "TMP")})
                print(f"planner CLI {rid:16s} --profile {profile:12s} {per_gpu:9.1f} tokens/s/GPU against "
                      f"{published} ({per_gpu / published:.2f}x)", flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| row | role | system | published | predicted before | ratio before | predicted after | ratio after |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pb = r.get("before", {}).get("predicted")
        pa = r.get("after", {}).get("predicted")
        cell = (lambda v: f"{v:,.1f}" if v is not None else "-")
        lines.append(f"| {r['id']} | {r['role']} | {r['system']} | {r['published']:,.2f} {r['metric']} | {cell(pb)} | "
                     f"{r['ratio_before']:.2f}x | {cell(pa)} | {r['ratio_after']:.2f}x |")
    return "\n".join(lines)


def worst(rows: list[dict], role: str, key: str) -> dict | None:
    sub = [r for r in rows if r["role"] == role]
    if not sub:
        return None
    r = max(sub, key=lambda r: abs(math.log(r[key])))
    return {"id": r["id"], "ratio": r[key], "error_pct": 100 * (r[key] - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-seq1f1b", action="store_true", help="skip the Seq1F1B pipeline rows")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    t0 = time.perf_counter()
    params = fit([r for r in ROWS if r["role"] == "fit"])
    print("fitted:", json.dumps(params), flush=True)
    rows = table(IDEAL, params, not args.no_seq1f1b)
    rows += own_run_rows(params)
    same_card = [r for r in rows if r["hardware"] != "a100"]
    summary = {k: worst(rows, role, key) for k, (role, key) in {
        "worst_fit_before": ("fit", "ratio_before"), "worst_fit_after": ("fit", "ratio_after"),
        "worst_held_out_before": ("held_out", "ratio_before"),
        "worst_held_out_after": ("held_out", "ratio_after")}.items()}
    summary["worst_held_out_after_h100_rows"] = worst(same_card, "held_out", "ratio_after")
    result = {"planner_cli_check": cli_check(), "fitted": params, "calibration": calibration_of(params).to_dict(), "factors": FACTORS,
              "rows": rows, "not_comparable": NOT_COMPARABLE, "summary": summary, "markdown": markdown(rows),
              "note": "predicted = the uncalibrated H100 layer profile's model of each system, converted by FACTORS; "
                      "before: ideal calibration and no compile / Float8 factor; after: the fitted parameters, each "
                      "system at its own whole-step efficiency",
              "wall_s": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(result, indent=1))
    calibrated = apply_calibration(uncalibrated_profile(), calibration_of(params))
    sources = {"epp": "this project's GPU suite, simulated / measured step on two H100 leases (docs/gpu.md)",
               **SYSTEMS, "other alternatives": "no measurement: EPP's (neutral)"}
    calibrated = replace(calibrated, name="h100-bf16-calibrated", meta={
        "source": "benchmarks/planner/calibration.py: the layer fit of profiles/h100_bf16_measurements.json with "
                  "the calibration fitted on published measurements and our own GPU runs (docs/calibration.md)",
        "efficiency_sources": sources})
    calibrated.save(PROFILE_OUT)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
