"""Simulator vs real on one GPU: one plan that slices, packs and checkpoints, timed per action.

    python -m benchmarks.gpu.gpu_sim_vs_real --profile DIR/llama3.2-1b.profile.json --out OUT.json
    python -m benchmarks.gpu.gpu_sim_vs_real --tiny --device cpu --out OUT.json     # smoke run

The engine (pp 1) plans a long-tailed batch (one long sequence cut into slices, its tail packed
with short ones, packs of short ones) under a memory budget low enough that adaptive
checkpointing must recompute, with the profile measured on this GPU; the step is then timed
(median of the timed steps) and each forward/backward is timed with CUDA events.  Reported:
simulated over measured step time (goal: within 5%), and per action the simulator's duration
over the measured one, so a miss is located (attention, recompute, fixed costs) rather than only
counted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import benchmarks.gpu.gpu_common as gc_
from benchmarks.gpu.memory_model_check import parse_case
from benchmarks.gpu.single_gpu import epp_rows

DEFAULT_CASE = "40960+8192+4096x2+2048x4+1024x8:4:adaptive:28"


def compare_actions(row: dict) -> dict:
    """Per-action predicted/measured ratios of the last timed step (matched by action name)."""
    measured = {a["action"]: a["ms"] for a in row.get("timeline", [])}
    predicted = {a["action"]: a for a in row.get("predicted_timeline", [])}
    actions = []
    for name, ms in measured.items():
        if name in predicted and ms > 0:
            p = predicted[name]
            actions.append({"action": name, "measured_ms": ms, "predicted_ms": p["ms"],
                            "predicted_recompute_ms": p["recompute_ms"], "ratio": p["ms"] / ms})
    out = {"actions": actions}
    for kind in ("F", "B"):
        got = sum(a["measured_ms"] for a in actions if a["action"][0] == kind)
        want = sum(a["predicted_ms"] for a in actions if a["action"][0] == kind)
        if got > 0:
            out[f"{kind}_predicted_over_measured"] = want / got
    ratios = [a["ratio"] for a in actions]
    if ratios:
        out["action_ratio_min"], out["action_ratio_median"], out["action_ratio_max"] = \
            min(ratios), statistics.median(ratios), max(ratios)
    if row.get("step_s"):
        out["actions_share_of_step"] = sum(a["measured_ms"] for a in actions) / 1e3 / row["step_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--case", default=DEFAULT_CASE, help="LENGTHS:SLICES:CHECKPOINTING[:BUDGET_GIB]")
    p.add_argument("--profile", default=None, help="profile measured on this GPU (default: shipped)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --tiny --device cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = gc_.load_config(args.config, args.tiny)
    lengths, k, ck, budget = parse_case(args.case)
    a = SimpleNamespace(attention_backend="auto", checkpointing=ck, num_slices=str(k), loss_chunk_tokens=4096,
                        warmup=args.warmup, steps=args.steps, memory_budget_gib=budget)
    seqs = [gc_.random_ids(n, config["vocab_size"], seed=i) for i, n in enumerate(lengths)]
    profile_path = gc_.bench_profile_path(args.profile, dtype, device)
    row = gc_.guarded(args.case, lambda: epp_rows(config, seqs, device, dtype, a, profile_path), device)
    result = {"env": gc_.environment(device), "profile": args.profile or "shipped default", "case": args.case,
              "lengths": lengths, "row": row}
    if "predicted_step_s" in row and row.get("step_s"):
        result["step_predicted_over_measured"] = row["predicted_step_s"] / row["step_s"]
        result["within_5_percent"] = abs(result["step_predicted_over_measured"] - 1) <= 0.05
        result.update(compare_actions(row))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("row", "actions", "env", "lengths")}))
    print(f"wrote {args.out}")
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())
