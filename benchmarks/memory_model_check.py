"""Memory-model check on one GPU: the planner's predicted peak vs measured ``max_memory_allocated``.

    python benchmarks/memory_model_check.py [--cases 32768:1:full,32768:4:adaptive,...] [--profile P]
    python benchmarks/memory_model_check.py --tiny --device cpu    # smoke run (no measurement)

Each case ``LENGTH:SLICES:CHECKPOINTING`` forces the engine's plan (pp 1, one sequence of LENGTH
tokens cut into SLICES slices, checkpointing ``none``/``full``/``adaptive``), runs warm-up and
timed steps (fused AdamW, so optimizer states are resident as the model assumes) and reports the
simulator's peak for stage 0 over the measured peak, and predicted over measured step time.  The
goal is a ratio within 5% of 1; what is reached is what the JSON says.  With ``--profile`` the
engine plans with a profile measured by ``python -m infinipipe_hf.profile`` on the model itself.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import gpu_common as gc_
import torch
from single_gpu import epp_rows

DEFAULT_CASES = ("8192:1:none,16384:1:none,16384:2:none,32768:4:adaptive,32768:1:full,65536:8:adaptive,"
                 "65536:4:full,131072:16:adaptive")


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
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_model_check.json"))
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
        try:
            n, k, ck = case.split(":")
            n, k = int(n), int(k)
        except ValueError:
            raise SystemExit(f"error: --cases items are LENGTH:SLICES:CHECKPOINTING, got {case!r}")
        a = SimpleNamespace(attention_backend=args.attention_backend, checkpointing=ck, num_slices=str(k),
                            loss_chunk_tokens=4096, warmup=args.warmup, steps=args.steps)
        seqs = [gc_.random_ids(n, config["vocab_size"], seed=n)]
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
