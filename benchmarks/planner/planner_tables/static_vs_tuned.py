"""Static vs per-batch tuned: what fixing a baseline's knobs for a whole run costs, on one node.

20 CommonCrawl-like batches of 512 sequences capped at 48K (``synthetic.commoncrawl_like``, seeds
0..19); Llama-2-7B on 4 GPUs (pp 4) and Llama-2-13B on 8 GPUs (pp 8), one node, unsharded
pipeline stages.  Every baseline and alternative is planned tuned per batch (its best knobs for
that batch) and as the best single static setting for all 20 batches (one packing length, slice
count, SP / CP degree and checkpoint count for the run; FlexSP: one checkpoint count, its groups
re-solved every step); EPP is per batch by design.  A run's throughput is its tokens over its total
simulated step time.
"""
from __future__ import annotations

from infinipipe_hf.data import synthetic

from .runs import fmt_k, fmt_x, plan_run, run_tps

NAME = "static_vs_tuned"
DESCRIPTION = "static vs per-batch tuned baselines and alternatives, 20 CommonCrawl-like 48K batches, one node"
SETUPS = (("llama2-7b", 4), ("llama2-13b", 8))
CAP = 48 * 1024
NUM_BATCHES = 20
BASELINES = ("packed-1f1b", "seq1f1b")
ALTERNATIVES = ("ulysses-zero3", "ring-cp", "flexsp")


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    n = 3 if quick else NUM_BATCHES
    batches = [synthetic.commoncrawl_like(n=512, max_len=CAP, seed=s) for s in range(n)]
    rows = []
    for model, pp in (SETUPS[:1] if quick else SETUPS):
        print(f"  {model} pp {pp} ({n} batches)", flush=True)
        out = plan_run(batches, model, pp=pp, memory_gib=memory_gib, profile=profile, baselines=BASELINES,
                       alternatives=ALTERNATIVES)
        rows.append({"model": model, "pp": pp, "gpus": pp, "run": out})
    return {"batch": f"synthetic.commoncrawl_like(n=512, max_len={CAP}, seed=0..{n - 1})", "num_batches": n,
            "memory_budget_gib": memory_gib, "rows": rows}


def _knobs(static: dict) -> str:
    if not static.get("feasible"):
        return "none fits every batch"
    k = dict(static["knobs"])
    k.pop("pack_log2", None)
    return ", ".join(f"{a}={b}" for a, b in k.items())


def markdown(report: dict) -> str:
    lines = ["| model, GPUs | schedule | tuned per batch | static for the run | static setting | tuned / static |",
             "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        o = row["run"]
        lines.append(f"| {row['model']}, {row['gpus']} | epp | {fmt_k(run_tps(o, 'epp'))} | - | per batch | - |")
        for name in (*BASELINES, *ALTERNATIVES):
            tuned, static = run_tps(o, name), run_tps(o, name, True)
            lines.append(f"| {row['model']}, {row['gpus']} | {name} | {fmt_k(tuned)} | {fmt_k(static)} | "
                         f"{_knobs(o['static'][name])} | {fmt_x(tuned, static)} |")
    return "\n".join(lines)
