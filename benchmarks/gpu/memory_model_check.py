"""Memory-model check on one GPU: the planner's predicted peak vs measured ``max_memory_allocated``.

    python -m benchmarks.gpu.memory_model_check [--cases 32768:4:none,4096x16:1:none,...] [--profile P]
    python -m benchmarks.gpu.memory_model_check --tiny --device cpu    # smoke run (no measurement)

Each case ``LENGTHS:SLICES:CHECKPOINTING[:BUDGET_GIB]`` forces the engine's plan (pp 1; LENGTHS is
one length or several joined by ``+``, ``NxK`` meaning K sequences of N tokens; the longest is cut
into SLICES slices; checkpointing ``none``/``full``/``adaptive``, the latter with every checkpoint
level; BUDGET_GIB caps the planner's memory budget so that ``adaptive`` must recompute), runs
warm-up and timed steps (fused AdamW, so optimizer states are resident as the model assumes) and
reports the simulator's peak for stage 0 over the measured peak, and predicted over measured step
time.  The goal is a ratio within 5% of 1; what is reached is what the JSON says.  With
``--profile`` the engine plans with a profile measured by ``python -m infinipipe_hf.profile``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import benchmarks.gpu.gpu_common as gc_
from benchmarks.gpu.single_gpu import epp_rows
from benchmarks.lib.paths import RESULTS

DEFAULT_CASES = ("8192:1:none,16384:1:none,16384:2:none,32768:4:adaptive,32768:1:full,65536:8:adaptive,"
                 "65536:4:full,131072:16:adaptive")


def parse_case(case: str) -> tuple[list[int], int, str, float | None]:
    """``LENGTHS:SLICES:CHECKPOINTING[:BUDGET_GIB]`` -> (lengths, slices, checkpointing, budget)."""
    parts = case.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        lengths = []
        for item in parts[0].split("+"):
            n, _, times = item.partition("x")
            lengths += [int(n)] * (int(times) if times else 1)
        budget = float(parts[3]) if len(parts) == 4 else None
        k = int(parts[1])
    except ValueError:
        raise SystemExit(f"error: --cases items are LENGTHS:SLICES:CHECKPOINTING[:BUDGET_GIB] with LENGTHS "
                         f"like 32768 or 40960+2048x6, got {case!r}") from None
    if parts[2] not in ("none", "full", "adaptive") or k < 1 or min(lengths) < 2:
        raise SystemExit(f"error: case {case!r}: checkpointing must be none, full or adaptive, SLICES >= 1 "
                         f"and every length >= 2")
    return lengths, k, parts[2], budget


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--profile", default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--out", default=str(RESULTS / "memory_model_check.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --tiny --device cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = gc_.load_config(args.config, args.tiny)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = gc_.bench_profile_path(args.profile, dtype, device)
    results = {"env": gc_.environment(device), "profile": args.profile or "shipped default",
               "dtype": args.dtype, "rows": []}
    for case in args.cases.split(","):
        lengths, k, ck, budget = parse_case(case)
        a = SimpleNamespace(attention_backend=args.attention_backend, checkpointing=ck, num_slices=str(k),
                            loss_chunk_tokens=4096, warmup=args.warmup, steps=args.steps,
                            memory_budget_gib=budget)
        seqs = [gc_.random_ids(n, config["vocab_size"], seed=i) for i, n in enumerate(lengths)]
        row = gc_.guarded(case, lambda: epp_rows(config, seqs, device, dtype, a, profile_path), device)
        if "predicted_step_s" in row and "step_s" in row and row["predicted_step_s"] > 0:
            row["step_predicted_over_measured"] = row["predicted_step_s"] / row["step_s"]
        row.pop("timeline", None)
        results["rows"].append({"case": case, **row})
        out.write_text(json.dumps(results, indent=1))
    ratios = [r["peak_predicted_over_measured"] for r in results["rows"] if "peak_predicted_over_measured" in r]
    if ratios:
        results["peak_ratio_min"], results["peak_ratio_max"] = min(ratios), max(ratios)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
