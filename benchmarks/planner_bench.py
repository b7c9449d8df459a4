"""Planner benchmark: EPP against its baselines on real and published-shape batches, side by side.

Every schedule plans the same global batch under the same cost model (the shipped H100/bf16
profile unless ``--profile`` is given) and memory budget; each baseline is tuned over its own knob
(packing length, uniform slice count, least uniform checkpointing that fits).  Reported figures are
*simulated* tokens/s from the cost model, not measured GPU throughput; planning time is measured
wall time on the machine that runs this script.

    python benchmarks/planner_bench.py                 # full run, writes benchmarks/results/planner_bench.json
    python benchmarks/planner_bench.py --quick         # fewer batches, for CI
    python benchmarks/planner_bench.py --tables checkpoint-levels   # also the tables of planner_tables/

Tables (``planner_tables/``, one module each, rows under ``tables`` in the JSON):
``checkpoint-levels``: checkpoint levels inside a layer before/after, recompute and bubble shares,
equal-memory speedups (planner_tables/checkpoint_levels.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from infinipipe_hf.data import synthetic
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.api import SCHEDULES, plan_step
from infinipipe_hf.planner.cost_model import GIB, CostModel
from infinipipe_hf.planner.hardware import HardwareProfile
from infinipipe_hf.planner.model_spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_tables import checkpoint_levels  # noqa: E402

SETUPS = [("llama2-7b", 4), ("llama2-13b", 8)]
TABLES = {"checkpoint-levels": checkpoint_levels.run}


def real_batch(corpora: tuple[str, ...], n: int, seed: int) -> list[int]:
    """``n`` real document lengths (SmolLM2 tokenizer) drawn without replacement from the pooled corpora."""
    import random

    from infinipipe_hf.data.corpus import document_lengths

    pool = [x for corpus in corpora for x in document_lengths(corpus) if x > 0]
    rng = random.Random(seed)
    return rng.sample(pool, min(n, len(pool)))


def batches(quick: bool) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    n = 128 if quick else 512
    real = [("stdlib",)] if quick else [("stdlib",), ("stdlib", "shakespeare", "kjv")]
    for corpora in real:
        try:
            out["real:" + "+".join(corpora)] = real_batch(corpora, n, seed=0)
        except Exception as exc:  # a missing optional corpus package is reported, not fatal
            print(f"skipping real:{'+'.join(corpora)}: {exc}", file=sys.stderr)
    out["synthetic:slimpajama-like"] = synthetic.slimpajama_like(n=n, max_len=131072, seed=0)
    out["synthetic:prolong-like"] = synthetic.prolong_like(n=n, max_len=131072, seed=0)
    out["synthetic:short-only"] = synthetic.short_only(n=n, max_len=2048, seed=0)
    return out


def run(quick: bool, profile_path: str | None, memory_gib: float, tables=()) -> dict:
    profile = HardwareProfile.load(profile_path) if profile_path else None
    results = []
    for model, pp in (SETUPS[:1] if quick else SETUPS):
        spec = ModelSpec.from_json_file(config_path(model))
        cost = CostModel(spec, profile, pp_degree=pp, memory_budget_bytes=memory_gib * GIB)
        for name, lengths in batches(quick).items():
            row = {"model": model, "pp": pp, "batch": name, "num_sequences": len(lengths),
                   "num_tokens": sum(lengths), "longest": max(lengths), "schedules": {}}
            for schedule in SCHEDULES:
                res = plan_step(lengths, spec, pp_degree=pp, schedule=schedule, cost=cost)
                row["schedules"][schedule] = res.summary()
            base = {s: r["tokens_per_s"] for s, r in row["schedules"].items() if s != "epp"}
            best_name = max(base, key=base.get)
            epp = row["schedules"]["epp"]["tokens_per_s"]
            row["best_baseline"] = best_name
            row["epp_speedup_vs_best_baseline"] = epp / base[best_name] if base[best_name] > 0 else None
            row["epp_planning_time_s"] = row["schedules"]["epp"]["planning_time_s"]
            results.append(row)
            print(format_row(row), flush=True)
    setups = [(m, pp, ModelSpec.from_json_file(config_path(m))) for m, pp in (SETUPS[:1] if quick else SETUPS)]
    done = {name: TABLES[name](setups, batches(quick), memory_gib, profile,
                               log=lambda line: print(line, flush=True)) for name in tables}
    return {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
            "memory_budget_gib": memory_gib, "profile": profile_path or "shipped h100-bf16-default",
            "note": "tokens/s are simulated with the cost model; planning_time_s is measured here",
            "results": results, "tables": done}


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
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_bench.json"))
    p.add_argument("--tables", nargs="*", default=[], choices=sorted(TABLES),
                   help="extra tables to compute (planner_tables/)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    report = run(args.quick, args.profile, args.gpu_memory_gib, args.tables)
    report["wall_time_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['wall_time_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
