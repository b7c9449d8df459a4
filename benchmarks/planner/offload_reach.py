"""How long a sequence the host tier trains, and how fast against ALST at the same length.

The setting: Llama-3.1-8B's shape with its positions raised (``max_position_embeddings``
2^25, nothing else changed), 80 GiB GPUs planned to the trainer's budget (8% margin, 2 GiB
reserve: 71.6 GiB), 256 GiB of host memory per GPU (a DGX H100's 2 TiB over 8 GPUs), 8 GPUs per
node.  For one sequence of 524,288 tokens on 1 GPU, 4,194,304 on 8 and 16,777,216 on 32:

- the layout search (``search_layouts``, the CLI's ``--search-layout --host-memory-gib 256``): its
  pick (layout, state offload, GPU peak, host peak, tokens/s) and, per layout, the largest
  trainable length with and without the host tier; per GPU count the largest over layouts;
- ALST (``planner/alternatives/alst.py``) at the same length on the same GPUs and budgets, and,
  since the paper ran ALST at 100% of the GPU's memory, also at 80 GiB with no margin; where one
  of them does not fit the length, both at the longest length both train (``at_common_length``:
  EPP as the layout search picks for that length) so that tokens/s still compare;
- which mechanism gives the lead: the shares of the step's GPU time each spends recomputing, idle
  (pipeline bubble, lockstep rounds) and in the CPU optimizer step's exposed tail.

Tokens/s and bytes are *simulated* with the default profile (named in the JSON; the host copy bandwidth and
the CPU optimizer rate are the profile's assumptions: 40 GB/s, 1e9 parameters/s).  The 32-GPU
search is restricted to ``sp`` in (4, 8, 16, 32) (recorded in the JSON; SP groups of 16 and 32
span nodes): the deeper pipelines of sp 1 and 2 take minutes each to plan one 16M sequence on a
2-core machine.

    python -m benchmarks.planner.offload_reach                # writes benchmarks/results/offload_reach.json
    python -m benchmarks.planner.offload_reach --quick        # Llama-3.2-1B shape, 2 GPUs, one short case
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.config import GIB, planning_budget
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.alst import ALSTCost, sp_degrees
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.host_tier import host_peak_bytes
from infinipipe_hf.planner.layout_search.result import NoLayoutFits
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.search.api import plan_alternative

OUT = RESULTS / "offload_reach.json"
CASES = ((1, 524_288, None), (8, 4_194_304, None), (32, 16_777_216, (4, 8, 16, 32)))
"""(GPUs, sequence length, SP degrees searched: None for all)."""
QUICK_CASES = ((2, 65_536, None),)
HOST_GIB = 256.0
GPU_GIB = 80.0


def long_spec(model: str, positions: int = 1 << 25) -> ModelSpec:
    return dataclasses.replace(ModelSpec.from_json_file(config_path(model)), max_position_embeddings=positions)


def alst_at(spec: ModelSpec, gpus: int, length: int, budget: float, host: float) -> dict:
    """ALST's summary for one sequence of ``length`` tokens (and the longest it trains)."""
    flat = FlatCost.of(spec, gpus, budget, default_profile(), 8)
    d = plan_alternative([length], spec, "alst", world_size=gpus, cost=flat, host_budget_bytes=host).summary()
    longest = max(ALSTCost(flat, host, sp).max_tokens() for sp in sp_degrees(flat))
    return {**_compact(d), "largest_length": longest, "memory_budget_bytes": budget}


def _profile_note() -> str:
    """The default profile the figures are simulated with, and its host-tier assumptions."""
    p = default_profile()
    return (f"{p.name} (host copies {p.host_bandwidth_bytes_per_s / 1e9:g} GB/s, CPU AdamW "
            f"{p.host_optimizer_params_per_s:g} params/s: assumptions)")


def _compact(d: dict) -> dict:
    keep = ("feasible", "tokens_per_s", "step_time_s", "peak_memory_bytes", "host_peak_memory_bytes",
            "recompute_time_s", "recompute_fraction", "bubble_fraction", "error", "info", "simulation_info",
            "layers_per_level")
    out = {k: d[k] for k in keep if k in d}
    if isinstance(out.get("peak_memory_bytes"), list):
        out["peak_memory_bytes"] = max(out["peak_memory_bytes"])
    return out


def shares_epp(summary: dict) -> dict:
    """Shares of the step's GPU time: recompute, idle (bubble, less the optimizer's tail), the
    exposed CPU optimizer step."""
    step = summary["step_time_s"]
    tail = (summary.get("simulation_info", {}).get("state_step_tail_s") or 0.0) / step
    return {"recompute": summary.get("recompute_fraction") or 0.0,
            "idle": max(0.0, (summary.get("bubble_fraction") or 0.0) - tail), "optimizer_tail": tail}


def shares_alst(d: dict, gpus: int) -> dict:
    step, info = d["step_time_s"], d.get("info", {})
    group, tail = info.get("sp_degree", gpus), (info.get("state_step_tail_s") or 0.0) / step
    return {"recompute": d["recompute_time_s"] * group / (step * gpus),
            "idle": max(0.0, (d.get("bubble_fraction") or 0.0) - tail), "optimizer_tail": tail}


def epp_summary(result) -> dict:
    """A plan result's summary with its simulation's info (the optimizer's tail is there)."""
    d = result.summary()
    d.setdefault("host_peak_memory_bytes", host_peak_bytes(result))
    if result.simulation is not None:
        d["simulation_info"] = dict(result.simulation.info)
    if result.plan is not None:
        d["layers_per_level"] = layers_per_level(result.plan)
    return d


def layers_per_level(plan) -> dict:
    """Layer-unit pairs of the plan at each checkpoint level (``kept``: none), over stages and units:
    which mechanism the plan leans on."""
    out = {"kept": 0, "full": 0}
    for s, layers in enumerate(plan.layers_per_stage):
        for u in plan.units:
            mix = plan.checkpoint_mix(s, u.id)
            out["kept"] += layers - mix.total
            out["full"] += mix.full
            for lv, n in mix.finer.items():
                out[lv] = out.get(lv, 0) + n
    return out


def seconds(shares: dict, step_s: float) -> dict:
    """The step's seconds per GPU by part: the shares, and the rest (compute and exposed copies)."""
    out = {k: v * step_s for k, v in shares.items()}
    out["compute_and_copies"] = step_s - sum(out.values())
    return out


def lead(epp: dict, alst: dict, gpus: int) -> dict:
    """Which part of the step decides the ratio (same length, same GPUs, seconds per GPU): the part
    where the slower one spends the most seconds beyond the faster."""
    e = seconds(shares_epp(epp), epp["step_time_s"])
    a = seconds(shares_alst(alst, gpus), alst["step_time_s"])
    ahead = epp["tokens_per_s"] >= alst["tokens_per_s"]
    gaps = {k: (a[k] - e[k]) if ahead else (e[k] - a[k]) for k in e}
    top = max(gaps, key=gaps.get)
    words = {"recompute": "recompute (ALST recomputes every layer, its attention too; EPP keeps, recomputes or "
                          "offloads per (stage, unit), and keeps attention outputs in host memory where the host "
                          "has room: offload_attn)",
             "idle": "idle time (pipeline bubble, lockstep rounds)",
             "optimizer_tail": "the exposed CPU optimizer step",
             "compute_and_copies": "compute and exposed host copies (slices attending to context, K/V and input copies)"}
    return {"epp_seconds": e, "alst_seconds": a, "epp_ahead": ahead, "mechanism": top,
            "epp_layers_per_level": epp.get("layers_per_level"),
            "says": f"{'EPP leads' if ahead else 'EPP trails'} by {words[top]}: {gaps[top]:.1f} s per step"}


def one_case(spec, gpus: int, length: int, sps, budget: float, host: float, full: float, workers: int) -> dict:
    t0 = time.perf_counter()
    try:
        search = search_layouts([length], spec, world_size=gpus, gpus_per_node=8, memory_budget_bytes=budget,
                                host_budget_bytes=host, sp_degrees=sps, workers=workers, alternatives=False,
                                longest=True)
    except NoLayoutFits as exc:
        search = exc.search
    rows = [o.to_dict() for o in search.layouts if o.largest_length is not None]
    row = {"gpus": gpus, "length": length, "sp_degrees_searched": list(sps) if sps else "all",
           "search_time_s": time.perf_counter() - t0, "layouts": rows,
           "largest_length": max((r["largest_length"] for r in rows), default=0),
           "largest_length_without_offload": max((r["largest_length_without_offload"] or 0 for r in rows), default=0)}
    best = search.recommended
    alst = alst_at(spec, gpus, length, budget, host)
    row["alst"], row["alst_full_memory"] = alst, alst_at(spec, gpus, length, full, host)
    if best is not None:
        epp = epp_summary(best.result)
        row["epp"] = {**_compact(epp), "layout": best.layout.degrees(), "state_offload": best.layout.state_offload.name}
        if alst["feasible"]:
            row["ratio"] = epp["tokens_per_s"] / alst["tokens_per_s"]
            row["lead"] = lead(epp, alst, gpus)
            return row
    else:
        row["epp"] = None
    row["at_common_length"] = common_length(spec, gpus, (sps, budget, host, workers), search, row, alst)
    return row


def common_length(spec, gpus: int, case: tuple, search, row: dict, alst: dict) -> dict | None:
    """Both at the longest length both train (on a 64K grid), when one of them does not fit the
    case's length: EPP as the layout search picks for that length (the same restriction)."""
    sps, budget, host, workers = case
    reach = [o.largest_length for o in search.layouts if o.largest_length]
    if not reach or not alst["largest_length"]:
        return None
    same = min(row["length"], alst["largest_length"], max(reach))
    same = same // 65536 * 65536 or same // 4096 * 4096
    if not same:
        return None
    try:
        pick = search_layouts([same], spec, world_size=gpus, gpus_per_node=8, memory_budget_bytes=budget,
                              host_budget_bytes=host, sp_degrees=sps, workers=workers, alternatives=False,
                              longest=False).recommended
    except NoLayoutFits:
        return None
    epp_same, alst_same = epp_summary(pick.result), alst_at(spec, gpus, same, budget, host)
    out = {"length": same, "layout": pick.layout.degrees(), "epp": _compact(epp_same), "alst": alst_same}
    if alst_same["feasible"]:
        out["ratio"] = epp_same["tokens_per_s"] / alst_same["tokens_per_s"]
        out["lead"] = lead(epp_same, alst_same, gpus)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Llama-3.2-1B shape, 16 GiB GPUs, 32 GiB host, 2 GPUs, one case")
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 2))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, gpu_gib, host_gib, cases = (("llama3.2-1b", 16.0, 32.0, QUICK_CASES) if args.quick
                                       else ("llama3.1-8b", GPU_GIB, HOST_GIB, CASES))
    spec = long_spec(model)
    budget = planning_budget(gpu_gib * GIB, 0.08, 2.0, None).budget_bytes
    host = host_gib * GIB
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = [one_case(spec, g, n, sps, budget, host, gpu_gib * GIB, args.workers) for g, n, sps in cases]
    report = {"model": model, "max_position_embeddings": spec.max_position_embeddings, "gpu_memory_gib": gpu_gib,
              "memory_budget_bytes": budget, "host_memory_gib_per_gpu": host_gib, "gpus_per_node": 8,
              "profile": _profile_note(),
              "rows": rows, "wall_s": time.perf_counter() - t0, "load_average_at_start": load,
              "machine": platform.platform()}
    out = Path(args.out) if args.out else (RESULTS / "offload_reach_quick.json" if args.quick else OUT)
    out.write_text(json.dumps(report, indent=1))
    for r in rows:
        e = r["epp"]
        print(f"{r['gpus']} GPU(s), {r['length']:,} tokens: EPP "
              + (f"{e['tokens_per_s']:,.0f} tokens/s on {e['layout']}" if e else "does not fit")
              + f"; ALST {r['alst']['tokens_per_s']:,.0f} tokens/s" + (f"; ratio {r['ratio']:.2f}" if "ratio" in r else "")
              + (f"; at {r['at_common_length']['length']:,}: ratio {r['at_common_length'].get('ratio', 0):.2f}"
                 if r.get("at_common_length") else "")
              + f"; largest {r['largest_length']:,} ({r['largest_length_without_offload']:,} without offload)")
    print(f"wrote {out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
