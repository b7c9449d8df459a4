"""The longest single sequence each schedule can train, at 80 GiB per GPU, for SP 1, 2, 4 and 8.

Llama-2-7B and Llama-2-13B shapes, pp 4, unsharded states (so the SP degree is the only change):
``planner.limits.largest_trainable_length`` per schedule -- the leanest plan each schedule could
choose (every layer checkpointed, as many slices as its grid allows), binary-searched on the
simulator's memory verdict.  gpipe equals packed-1f1b for a single sequence (one micro-batch).
"""
from __future__ import annotations

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.limits import largest_trainable_length

from .common import spec_of

NAME = "sp_limits"
DESCRIPTION = "largest trainable sequence per schedule, Llama-2 7B/13B, pp 4, sp 1/2/4/8, 80 GiB"
MODELS = ("llama2-7b", "llama2-13b")
SP_DEGREES = (1, 2, 4, 8)
SCHEDULES = ("epp", "seq1f1b", "packed-1f1b")
PP = 4


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    rows = []
    for model in (MODELS[:1] if quick else MODELS):
        spec = spec_of(model)
        for sp in ((1, 8) if quick else SP_DEGREES):
            cost = CostModel(spec, profile, ParallelDims(pp_degree=PP, sp_degree=sp), memory_budget_bytes=memory_gib * GIB)
            limits = {s: largest_trainable_length(cost, schedule=s) for s in SCHEDULES}
            rows.append({"model": model, "pp": PP, "sp": sp, "largest_tokens": limits})
            print(f"{model:>10} pp{PP} sp{sp}  " + "  ".join(f"{s}={n:,}" for s, n in limits.items()), flush=True)
    return {"memory_budget_gib": memory_gib, "shard": "none", "rows": rows}


def markdown(report: dict) -> str:
    lines = ["| model, pp 4 | sp | EPP | seq1f1b | packed-1f1b (= gpipe) |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        n = row["largest_tokens"]
        lines.append(f"| {row['model']} | {row['sp']} | {n['epp'] / 1024:.0f}K | {n['seq1f1b'] / 1024:.0f}K | "
                     f"{n['packed-1f1b'] / 1024:.0f}K |")
    return "\n".join(lines)
