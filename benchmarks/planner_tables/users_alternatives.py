"""The systems HF users run instead of a pipeline, on the planner benchmark's batches and GPUs.

The batches and setups of the main planner table (``setups.py``: 512 sequences of real
Python-stdlib lengths, the stdlib + Shakespeare + KJV mix, SlimPajama-like and ProLong-like
synthetic ones to 128K, short ones; Llama-2-7B on 4 GPUs as pp 4, Llama-2-13B on 8 GPUs as pp 8,
one node, 80 GiB): EPP and the best pipeline baseline against ``ulysses-zero3`` (DeepSpeed-Ulysses
+ ZeRO-3), ``ring-cp`` (FSDP2 + ring attention) and ``flexsp`` on the same GPUs, each tuned per
batch over its knobs (chosen knobs shown).  EPP is also planned with Ulysses SP inside its stages on
the same GPUs (every ``pp x sp`` split, states sharded over SP), since a user picks the layout too:
the column "EPP, best pp x sp" is the fastest of those and of plain pp.  Single batches; the
32-GPU, 20-batch comparison is the paper table.
"""
from __future__ import annotations

from infinipipe_hf.planner.registry import ALTERNATIVES

from .common import plan_schedules
from .runs import fmt_k
from .setups import SETUPS, batches

NAME = "users_alternatives"
DESCRIPTION = "EPP vs DeepSpeed-Ulysses+ZeRO-3, FSDP2 ring CP and FlexSP on the planner benchmark's batches"
PIPELINES = ("epp", "packed-1f1b", "seq1f1b")


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    rows = []
    for model, pp in (SETUPS[:1] if quick else SETUPS):
        for name, lengths in batches(quick).items():
            plans = plan_schedules(lengths, model, (*PIPELINES, *ALTERNATIVES), pp=pp, memory_gib=memory_gib,
                                   profile=profile)
            layouts = {}
            for sp in (d for d in (2, 4, 8) if pp % d == 0):
                layouts[f"pp{pp // sp}xsp{sp}"] = plan_schedules(lengths, model, ("epp",), pp=pp // sp, sp=sp, shard="sp",
                                                                 memory_gib=memory_gib, profile=profile)["epp"]
            rows.append({"model": model, "gpus": pp, "batch": name, "num_tokens": sum(lengths),
                         "longest": max(lengths), "schedules": plans, "epp_sp_layouts": layouts})
            print(f"  {model} {pp} GPUs {name:<26} " + "  ".join(f"{k}={fmt_k(v['tokens_per_s'])}"
                                                                  for k, v in plans.items()), flush=True)
    return {"memory_budget_gib": memory_gib, "rows": rows}


LABELS = {"sp_degree": "sp", "cp_degree": "cp", "pack_tokens": "pack", "num_rounds": "rounds",
          "checkpoint_layers": "ckpt"}


def _knobs(s: dict) -> str:
    return ", ".join(f"{label} {s[k]}" for k, label in LABELS.items() if k in s)


def markdown(report: dict) -> str:
    lines = ["| model, GPUs | batch | EPP (pp = GPUs) | EPP, best pp x sp | best pipeline baseline | "
             "DeepSpeed-Ulysses + ZeRO-3 | FSDP2 ring CP | FlexSP | EPP / best alternative (best pp x sp) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        s = row["schedules"]
        base = max(("packed-1f1b", "seq1f1b"), key=lambda k: s[k]["tokens_per_s"])
        alts = {k: s[k]["tokens_per_s"] for k in ALTERNATIVES}
        best_alt = max(alts.values())
        epp = s["epp"]["tokens_per_s"]
        ratio = f"{epp / best_alt:.2f}x" if epp and best_alt else ("only EPP fits" if epp else "n/a")
        layouts = {f"pp{row['gpus']}xsp1": s["epp"], **row.get("epp_sp_layouts", {})}
        where, top = max(layouts.items(), key=lambda kv: kv[1]["tokens_per_s"] or 0.0)
        best_epp = top["tokens_per_s"] or 0.0
        if best_epp and best_alt:
            ratio += f" ({best_epp / best_alt:.2f}x)"
        cells = [f"{fmt_k(s[k]['tokens_per_s'])}" + (f" ({_knobs(s[k])})" if s[k]["feasible"] else "")
                 for k in ALTERNATIVES]
        lines.append(f"| {row['model']}, {row['gpus']} | {row['batch']} | {fmt_k(epp)} | {fmt_k(best_epp)} ({where}) | "
                     f"{fmt_k(s[base]['tokens_per_s'])} ({base}) | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)
