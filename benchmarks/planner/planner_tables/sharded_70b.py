"""Llama-2-70B on 16 GPUs (2 nodes x 8): which pp x sp x shard layouts fit, and how fast.

One long-tailed batch of 512 sequences (``synthetic.slimpajama_like``, capped at 48K tokens, as the paper-layout table's first cap),
EPP, 80 GiB per GPU.  Per layout: the model states per GPU during a step (the floor every plan
pays), feasibility and simulated tokens/s.  Sharded states are costed as the runtime runs them:
FSDP2 with gradients accumulated over the step's units and reduce-scattered once per step, which
keeps every parameter's fp32 gradient *unsharded* until then (4 bytes per parameter of the
stage).  Rows marked ``unit`` are a what-if the runtime does not implement: reduce-scatter after
every backward (FSDP2's default without accumulation), which keeps no unsharded gradient.
"""
from __future__ import annotations

from infinipipe_hf.data import synthetic

from .common import fmt_tps, plan_schedules

NAME = "sharded_70b"
DESCRIPTION = "Llama-2-70B, 16 GPUs (2 x 8), 512-seq long-tailed batch, layouts sharded vs unsharded"
MODEL = "llama2-70b"
CAP = 48 * 1024
# (pp, sp, dp, shard, grad_reduce)
LAYOUTS = [
    (16, 1, 1, "none", "step"),
    (8, 2, 1, "none", "step"), (8, 2, 1, "sp", "step"), (8, 2, 1, "sp", "unit"),
    (4, 4, 1, "none", "step"), (4, 4, 1, "sp", "step"), (4, 4, 1, "sp", "unit"),
    (2, 8, 1, "none", "step"), (2, 8, 1, "sp", "step"), (2, 8, 1, "sp", "unit"),
    (4, 2, 2, "sp+dp", "step"), (4, 2, 2, "sp+dp", "unit"),
]
QUICK_LAYOUTS = [LAYOUTS[0], LAYOUTS[8], LAYOUTS[9]]


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    lengths = synthetic.slimpajama_like(n=512, max_len=CAP, seed=0)
    rows = []
    for pp, sp, dp, shard, grad_reduce in (QUICK_LAYOUTS if quick else LAYOUTS):
        epp = plan_schedules(lengths, MODEL, ("epp",), pp=pp, sp=sp, dp=dp, shard=shard, memory_gib=memory_gib,
                             profile=profile, grad_reduce=grad_reduce)["epp"]
        row = {"pp": pp, "sp": sp, "dp": dp, "shard": shard, "grad_reduce": grad_reduce, "epp": epp}
        rows.append(row)
        print(f"70B pp{pp} sp{sp} dp{dp} shard={shard:<5} reduce={grad_reduce:<4} states "
              f"{epp['static_memory_gib']:6.1f} GiB  epp={fmt_tps(epp)}", flush=True)
    return {"model": MODEL, "gpus": 16, "gpus_per_node": 8, "memory_budget_gib": memory_gib,
            "batch": f"synthetic.slimpajama_like(n=512, max_len={CAP}, seed=0)", "num_tokens": sum(lengths),
            "longest": max(lengths), "rows": rows}


def markdown(report: dict) -> str:
    lines = ["| pp x sp x dp | shard | gradients reduced | states per GPU | EPP fits | EPP tok/s |",
             "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        e = row["epp"]
        reduce = "-" if row["shard"] == "none" else ("once per step" if row["grad_reduce"] == "step"
                                                     else "every unit (what-if)")
        lines.append(f"| {row['pp']} x {row['sp']} x {row['dp']} | {row['shard']} | {reduce} | "
                     f"{e['static_memory_gib']:.1f} GiB | {'yes' if e['feasible'] else 'no'} | {fmt_tps(e)} |")
    return "\n".join(lines)
