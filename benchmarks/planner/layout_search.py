"""Layout search: is the recommended layout the fastest that fits, and how long does the search take?

On the planner benchmark's one-node setup (Llama-2-13B, 8 GPUs; its batches of 512 sequences,
``planner_tables/setups.py``) and the paper's 32-GPU setup (4 nodes x 8 GPUs; Llama 7B/13B/30B,
512-sequence SlimPajama-like batches capped at 48K and 96K, ``planner_tables/paper_layout.py``):

- ``search_layouts`` (the CLI's ``--search-layout``) with its own wall time (``search_time_s``: the
  layouts, the non-pipeline alternatives and the pick replanned without rounds; the layouts' part
  alone is ``search_layouts_time_s``, to compare with the brute force), pruning layouts by a proven
  bound (``num_pruned``, each pruned layout's bound in ``pruned``);
- a brute force: ``plan_step`` on every enumerated layout, no pruning, no sharing of plans between
  shard modes -- the recommended layout must be its fastest feasible one, every planned layout must
  match it, and every pruned layout must be no faster than its bound and slower than the pick;
- the default ``pp = world`` (sp 1, dp 1, unsharded) and, at 32 GPUs, the paper's pp 4 x sp 8
  sharded over SP; and the non-pipeline alternatives at their best.

Tokens/s are simulated with the cost model (shipped H100/bf16 profile, 80 GiB per GPU); times are
measured on the machine that runs this (recorded with its load average, the CPUs are shared).

    python -m benchmarks.planner.layout_search            # writes benchmarks/results/layout_search.json
    python -m benchmarks.planner.layout_search --quick    # one batch per setup
    python -m benchmarks.planner.layout_search --match 96K --out benchmarks/results/layout_search_96k.json  # some cases
    python -m benchmarks.planner.layout_search --match "32 GPUs llama2-13b" --no-brute-force   # the search alone
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.lib.paths import RESULTS
from benchmarks.planner.planner_tables.paper_layout import CAPS, MODELS
from benchmarks.planner.planner_tables.setups import batches
from infinipipe_hf.data import synthetic
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.prune import PrunedOutcome
from infinipipe_hf.planner.layout_search.result import NoLayoutFits
from infinipipe_hf.planner.layout_search.search import SearchInputs, search_layouts
from infinipipe_hf.planner.search.api import plan_step

OUT = RESULTS / "layout_search.json"
PAPER = ParallelDims(4, 8, 1, "sp")


def brute_force(lengths, spec, layouts, budget, gpus_per_node) -> tuple[dict, float]:
    """``plan_step`` on every layout; ``(label -> compact row, seconds)``."""
    inputs = SearchInputs(lengths, spec, default_profile(), budget, gpus_per_node, {})
    t0 = time.perf_counter()
    rows = {}
    for lay in layouts:
        r = plan_step(lengths, spec, ParallelDims(pp_degree=lay.pp_degree, dp_degree=lay.dp_degree, sp_degree=lay.sp_degree, shard=lay.shard), cost=inputs.cost(lay))
        rows[key(lay)] = {"feasible": r.feasible, "tokens_per_s": r.simulation.tokens_per_s if r.feasible else 0.0,
                          "planning_time_s": r.planning_time_s}
    return rows, time.perf_counter() - t0


def key(lay: ParallelDims) -> str:
    return f"pp{lay.pp_degree}xsp{lay.sp_degree}xdp{lay.dp_degree}:{lay.shard}"


def one_row(setup: str, model: str, batch: str, lengths: list[int], world: int, gpn: int, budget: float,
            workers: int = 1, with_brute: bool = True) -> dict:
    spec = ModelSpec.from_json_file(config_path(model))
    load = os.getloadavg()[0]
    try:
        search = search_layouts(lengths, spec, world_size=world, gpus_per_node=gpn, memory_budget_bytes=budget,
                                workers=workers)
    except NoLayoutFits as exc:
        search = exc.search
    load_after_search = os.getloadavg()[0]
    layouts = [o.layout for o in search.layouts]
    brute, brute_s = brute_force(lengths, spec, layouts, budget, gpn) if with_brute else ({}, None)
    rec = search.recommended
    row = {"setup": setup, "model": model, "batch": batch, "gpus": world, "gpus_per_node": gpn,
           "num_sequences": len(lengths), "num_tokens": sum(lengths), "longest": max(lengths),
           "recommended": key(rec.layout) if rec else None, "recommended_tokens_per_s": rec.tokens_per_s if rec else 0.0,
           "num_layouts": len(layouts),
           "num_planned_by_search": sum(o.result is not None and o.priced_as is None for o in search.layouts),
           "num_ruled_out_before_planning": sum(o.ruled_out is not None for o in search.layouts),
           "num_pruned": sum(isinstance(o, PrunedOutcome) for o in search.layouts),
           "pruned": {key(o.layout): o.bound_tokens_per_s for o in search.layouts if isinstance(o, PrunedOutcome)},
           "search_workers": workers, "search_time_s": search.search_time_s, "brute_force_time_s": brute_s,
           "load_average_1min": load, "load_average_1min_after_search": load_after_search,
           "search_layouts_time_s": sum(o.search_time_s for o in search.layouts),
           "search_alternatives_time_s": sum(r.planning_time_s for r in search.alternatives.values()),
           "alternatives": {n: r.simulation.tokens_per_s if r.feasible else 0.0 for n, r in search.alternatives.items()},
           "layouts": brute}
    if with_brute:
        row.update(against_brute_force(search, brute))
    for name, lay in (("pp_equals_world", ParallelDims(world, 1, 1, "none")), ("paper_pp4_sp8_shard_sp", PAPER)):
        if key(lay) in brute and (name == "pp_equals_world" or world == 32):
            base = brute[key(lay)]["tokens_per_s"]
            row[f"over_{name}"] = row["recommended_tokens_per_s"] / base if base else None
    whole = search.without_sp_rounds
    row["recommended_uses_sp_rounds"] = bool(rec and rec.sp_rounds)
    row["recommended_without_sp_rounds_tokens_per_s"] = (whole.simulation.tokens_per_s if whole and whole.feasible
                                                         else None)
    best_alt = max(row["alternatives"].values(), default=0.0)
    row["over_best_alternative"] = row["recommended_tokens_per_s"] / best_alt if best_alt else None
    return row


def against_brute_force(search, brute: dict) -> dict:
    """The search against the brute force: the same pick, the same figures on every layout it
    planned, ruled-out layouts infeasible and pruned ones no faster than their bound and the pick."""
    fastest = max((v["tokens_per_s"] for v in brute.values()), default=0.0)
    winners = sorted(k for k, v in brute.items() if v["feasible"] and v["tokens_per_s"] >= fastest * (1 - 1e-9))
    rec = search.recommended
    pruned = [o for o in search.layouts if isinstance(o, PrunedOutcome)]
    differ = [{"layout": key(o.layout), "search_tokens_per_s": o.tokens_per_s, "search_error": o.error,
               "brute_force_tokens_per_s": brute[key(o.layout)]["tokens_per_s"]} for o in search.layouts
              if not isinstance(o, PrunedOutcome)
              and abs(o.tokens_per_s - brute[key(o.layout)]["tokens_per_s"]) > 1e-9 * max(1.0, o.tokens_per_s)]
    return {"brute_force_fastest": winners, "brute_force_tokens_per_s": fastest,
            "recommended_is_fastest": bool(rec) and key(rec.layout) in winners,
            "every_planned_layout_same_as_brute_force": not differ, "layouts_differing_from_brute_force": differ,
            "ruled_out_layouts_infeasible_in_brute_force": all(not brute[key(o.layout)]["feasible"]
                                                               for o in search.layouts if o.ruled_out),
            "pruned_layouts_within_bound_and_slower": all(
                brute[key(o.layout)]["tokens_per_s"] <= o.bound_tokens_per_s < fastest for o in pruned),
            "pruned_brute_force_tokens_per_s": {key(o.layout): brute[key(o.layout)]["tokens_per_s"] for o in pruned},
            "num_feasible": sum(v["feasible"] for v in brute.values())}


def line(row: dict) -> str:
    x = row.get("over_pp_equals_world")
    brute = "not run" if row["brute_force_time_s"] is None else f"{row['brute_force_time_s']:.1f} s"
    return (f"{row['model']:>10} {row['gpus']:>2} GPUs {row['batch']:<28} pick {row['recommended']} "
            f"{row['recommended_tokens_per_s'] / 1e3:.1f}K  fastest={row.get('recommended_is_fastest')}  "
            f"vs pp=world {'%.2fx' % x if x else 'n/a'}  search {row['search_time_s']:.1f} s, "
            f"{row['num_pruned']} pruned (brute {brute}, load {row['load_average_1min']:.1f})")


def cases(quick: bool):
    """``(setup, model, batch name, lengths, world, gpus_per_node)`` of every row."""
    one_node = batches(quick)
    for name in list(one_node)[:1] if quick else one_node:
        yield "one node, 8 GPUs", "llama2-13b", name, one_node[name], 8, 8
    for cap in CAPS[:1] if quick else CAPS:
        lengths = synthetic.slimpajama_like(n=512, max_len=cap, seed=0)
        for model in MODELS[:1] if quick else MODELS:
            yield "4 nodes x 8 GPUs", model, f"slimpajama-like cap {cap // 1024}K", lengths, 32, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-gib", type=float, default=80.0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--match", default=None, metavar="TEXT",
                    help="run only the cases whose 'GPUs model batch' contains TEXT (e.g. '96K')")
    ap.add_argument("--workers", type=int, default=1, help="the search's worker processes (search_layouts workers)")
    ap.add_argument("--no-brute-force", action="store_true",
                    help="time the search alone (the brute force plans every layout: minutes at 32 GPUs)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    all_cases = [c for c in cases(args.quick) if args.match is None or args.match in f"{c[4]} GPUs {c[1]} {c[2]}"]
    for setup, model, name, lengths, world, gpn in all_cases:
        rows.append(one_row(setup, model, name, lengths, world, gpn, args.memory_gib * GIB, args.workers,
                            not args.no_brute_force))
        print(line(rows[-1]), flush=True)
        write(args, rows, len(all_cases), time.perf_counter() - t0)  # after every row: a long run keeps its rows
    print(f"wrote {args.out}")


def write(args: argparse.Namespace, rows: list[dict], num_cases: int, wall_s: float) -> None:
    searches = [r["search_time_s"] for r in rows]
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "memory_budget_gib": args.memory_gib,
              "profile": "shipped default", "search_workers": args.workers, "quick": args.quick,
              "match": args.match, "brute_force": not args.no_brute_force,
              "complete": len(rows) == num_cases, "num_rows": len(rows), "num_cases": num_cases,
              "note": "tokens/s simulated by the cost model; times measured here on shared CPUs (load average "
                      "per row); the search prunes layouts by a proven bound (num_pruned); the brute force plans "
                      "every layout with plan_step, no pruning, no sharing between shard modes",
              "all_recommended_are_fastest": all(r.get("recommended_is_fastest") for r in rows)
              if not args.no_brute_force else None,
              "search_time_s": {"mean": sum(searches) / len(searches), "worst": max(searches)},
              "search_layouts_time_s": {"mean": sum(r["search_layouts_time_s"] for r in rows) / len(rows),
                                        "worst": max(r["search_layouts_time_s"] for r in rows)},
              "wall_time_s": wall_s, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
