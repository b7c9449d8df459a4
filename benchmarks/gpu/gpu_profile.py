"""Profile model layer shapes on this GPU and compare the fits with the shipped H100 profile.

    python -m benchmarks.gpu.gpu_profile --models llama3.2-1b,llama2-7b --out OUT.json --profile-dir DIR
    python -m benchmarks.gpu.gpu_profile --tiny --device cpu --out OUT.json --profile-dir DIR   # smoke run

For each model: ``infinipipe_hf.profiling.run.run_profile`` on its layer shape (a short grid), the
fitted profile saved as ``DIR/<model>.profile.json`` (what the later GPU steps plan with), and per
measured row the times predicted by that fit and by the shipped layer fit (the default profile
without its whole-step calibration) rescaled to the model's shape (``CostModel``'s FLOP scaling), so
one table shows how far the shipped layer fit is from this GPU.  The fits here stay uncalibrated
(``run_profile(calibrate=False)``): the later steps check the simulator against the runtime, which
a whole-step efficiency would hide.  The JSON is rewritten after each model: a timeout keeps the finished ones.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import benchmarks.gpu.gpu_common as gc_
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, uncalibrated_profile


def _layer_ms(cost: CostModel, tokens: int) -> tuple[float, float]:
    pairs = tokens * tokens
    return cost.coefficients.layer_fwd(pairs, tokens) * 1e3, cost.coefficients.layer_bwd(pairs, tokens) * 1e3


def compare_rows(config: dict, fitted: HardwareProfile, rows: list[dict]) -> list[dict]:
    """Measured layer and head rows beside the fitted and the shipped profile's predictions."""
    spec = ModelSpec.from_config_dict(config)
    models = {"fitted": CostModel(spec, fitted), "shipped": CostModel(spec, uncalibrated_profile())}
    out = []
    for r in rows:
        n = int(r.get("tokens", 0))
        if r.get("kind") == "layer_causal":
            got = {"fwd_ms": r["fwd_ms"], "bwd_ms": r["fwd_bwd_ms"] - r["fwd_ms"]}
            pred = {name: _layer_ms(c, n) for name, c in models.items()}
        elif r.get("kind") == "lm_head_ce":
            got = {"fwd_ms": r["fwd_ms"], "bwd_ms": r["fwd_bwd_ms"] - r["fwd_ms"]}
            pred = {name: (c.coefficients.head_fwd(0, n) * 1e3, c.coefficients.head_bwd(0, n) * 1e3) for name, c in models.items()}
        else:
            continue
        row = {"kind": r["kind"], "tokens": n, **got}
        for name, (f, b) in pred.items():
            row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = f, b
            row[f"{name}_over_measured_fwd_bwd"] = (f + b) / (got["fwd_ms"] + got["bwd_ms"])
        out.append(row)
    return out


def profile_model(name: str, config: dict, args) -> dict:
    from infinipipe_hf.profiling.run import run_profile

    t0 = time.perf_counter()
    prof, doc = run_profile(config, device=args.device, dtype=args.dtype,
                            lengths=[int(x) for x in args.lengths.split(",")],
                            head_tokens=[int(x) for x in args.head_tokens.split(",")],
                            slice_attention=[tuple(int(v) for v in p.split(":")) for p in
                                             args.slice_attention.split(",") if p],
                            warmup=args.warmup, repeat=args.repeat, name=f"{name}-{args.dtype}",
                            log=lambda s: print(s, file=sys.stderr, flush=True), calibrate=False,
                            attention_tokens=[])
    path = Path(args.profile_dir) / f"{name}.profile.json"
    prof.save(path)  # before the attention table: a FlexAttention compile that runs out of time keeps it
    if name in args.attention_models.split(",") or args.tiny:
        prof = _with_attention_table(prof, config, args)
        prof.save(path)
    table = compare_rows(config, prof, doc["rows"])
    ratios = [r["shipped_over_measured_fwd_bwd"] for r in table if r["kind"] == "layer_causal"]
    fit = [r["fitted_over_measured_fwd_bwd"] for r in table]
    return {"model": name, "profile_path": str(path), "wall_s": time.perf_counter() - t0,
            "profile": prof.to_dict(), "rows": doc["rows"], "env": doc["env"], "comparison": table,
            "shipped_over_measured_layer": [min(ratios), max(ratios)] if ratios else None,
            "fitted_over_measured_all": [min(fit), max(fit)] if fit else None}


def _with_attention_table(prof: HardwareProfile, config: dict, args) -> HardwareProfile:
    """``prof`` with the attention backends timed per unit kind on this device (its routing table)."""
    import dataclasses

    import torch

    from infinipipe_hf.profiling.attention_backends import attention_table
    from infinipipe_hf.profiling.run import DTYPES

    heads, kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    table = attention_table(heads, kv, head_dim, device, getattr(torch, DTYPES[args.dtype]),
                            tokens=[16, 32] if args.tiny else None, warmup=args.warmup, repeat=args.repeat,
                            budget_s=args.attention_budget_s, log=lambda s: print(s, file=sys.stderr, flush=True))
    return dataclasses.replace(prof, attention_backends=table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama3.2-1b,llama2-7b", help="shipped model config names")
    p.add_argument("--tiny", action="store_true", help="profile the tiny test shape instead (smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--head-tokens", default="1024,4096")
    p.add_argument("--slice-attention", default="4096:28672")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile-dir", required=True, help="where the fitted profiles are saved")
    p.add_argument("--attention-models", default="llama3.2-1b",
                   help="models whose attention backends are timed per unit kind (the routing table)")
    p.add_argument("--attention-budget-s", type=float, default=15.0, help="seconds the attention table may take")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    names = ["tiny"] if args.tiny else args.models.split(",")
    results = {"shipped_profile": uncalibrated_profile().name, "args": vars(args), "models": []}
    failed = 0
    for name in names:
        config = gc_.load_config(None, True) if args.tiny else _config(name)
        try:
            results["models"].append(profile_model(name, config, args))
        except Exception as exc:  # noqa: BLE001 - record it and go on to the next model
            failed += 1
            results["models"].append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:600]})
        out.write_text(json.dumps(results, indent=1))
        m = results["models"][-1]
        print(json.dumps({k: m.get(k) for k in ("model", "wall_s", "shipped_over_measured_layer",
                                                  "fitted_over_measured_all", "error")}), flush=True)
    print(f"wrote {out}")
    return 1 if failed else 0


def _config(name: str) -> dict:
    from infinipipe_hf.models.model_configs import config_path

    with open(config_path(name)) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
