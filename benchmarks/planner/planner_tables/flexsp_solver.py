"""FlexSP's solvers on real rounds: the greedy against the paper's MILP on length buckets.

For each setting (Llama-2-7B and LLaMA-30B on 32 GPUs, a GitHub-like 512-sequence batch capped at
48K and 96K), FlexSP is planned with the greedy; then every round of that plan is solved again with
the MILP (``MILP_BUCKETS`` buckets, HiGHS, ``TIME_LIMIT_S`` per round), both on the same round
problem.  A ratio above 1 means the greedy's round is slower than the MILP's; below 1, the MILP
(buckets, stopped at its time limit) did worse.
"""
from __future__ import annotations

import time

from infinipipe_hf.data import synthetic
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.flexsp_build import MILP_BUCKETS, round_problem
from infinipipe_hf.planner.alternatives.flexsp_solver import milp_groups
from infinipipe_hf.planner.batch.group_packing import greedy_groups
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.search.api import plan_alternative

from .common import spec_of

NAME = "flexsp_solver"
DESCRIPTION = "FlexSP greedy vs bucketed MILP on the rounds of real 32-GPU plans"
SETTINGS = (("llama2-7b", 48 * 1024), ("llama2-7b", 96 * 1024), ("llama-30b", 48 * 1024), ("llama-30b", 96 * 1024))
TIME_LIMIT_S = 10.0


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    rows = []
    for model, cap in (SETTINGS[:1] if quick else SETTINGS):
        spec = spec_of(model)
        cost = FlatCost.of(spec, 32, memory_gib * GIB, profile, 8)
        lengths = synthetic.github_like(n=512, max_len=cap, seed=0)
        res = plan_alternative(lengths, spec, "flexsp", world_size=32, cost=cost)
        c = res.plan.checkpoint_layers
        sizes = cost.group_sizes("ulysses")
        for i, rnd in enumerate(res.plan.rounds):
            seqs = [s for g in rnd for s in g.seqs]
            prob = round_problem(lengths, seqs, cost, c, sizes)
            t0 = time.perf_counter()
            greedy = greedy_groups(prob)
            t1 = time.perf_counter()
            milp = milp_groups(prob, MILP_BUCKETS, TIME_LIMIT_S)
            t2 = time.perf_counter()
            row = {"model": model, "cap": cap, "round": i, "sequences": len(seqs), "checkpoint_layers": c,
                   "greedy_s": prob.makespan(greedy) if greedy else None, "greedy_time_s": t1 - t0,
                   "milp_s": prob.makespan(milp) if milp else None, "milp_time_s": t2 - t1}
            rows.append(row)
            print(f"  {model} {cap // 1024}K round {i}: {len(seqs)} seqs greedy {row['greedy_s']:.3f} s "
                  f"({row['greedy_time_s'] * 1e3:.0f} ms), milp {row['milp_s'] or float('nan'):.3f} s "
                  f"({row['milp_time_s']:.2f} s)", flush=True)
    ratios = [r["greedy_s"] / r["milp_s"] for r in rows if r["greedy_s"] and r["milp_s"]]
    return {"milp_buckets": MILP_BUCKETS, "milp_time_limit_s": TIME_LIMIT_S, "rows": rows,
            "greedy_over_milp": {"mean": sum(ratios) / len(ratios) if ratios else None,
                                 "max": max(ratios, default=None), "min": min(ratios, default=None),
                                 "rounds": len(rows), "milp_found": len(ratios)}}


def markdown(report: dict) -> str:
    lines = ["| model | cap | rounds | greedy / MILP makespan, mean (min - max) | greedy time per round | "
             "MILP time per round |", "|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["cap"]) for r in report["rows"]}, key=lambda k: (k[0], k[1]))
    for model, cap in keys:
        rs = [r for r in report["rows"] if r["model"] == model and r["cap"] == cap]
        q = [r["greedy_s"] / r["milp_s"] for r in rs if r["greedy_s"] and r["milp_s"]]
        ratio = f"{sum(q) / len(q):.3f} ({min(q):.3f} - {max(q):.3f})" if q else "MILP found none"
        lines.append(f"| {model} | {cap // 1024}K | {len(rs)} | {ratio} | "
                     f"{1e3 * sum(r['greedy_time_s'] for r in rs) / len(rs):.0f} ms | "
                     f"{sum(r['milp_time_s'] for r in rs) / len(rs):.2f} s |")
    return "\n".join(lines)
