"""The InfiniPipe paper's layout: 32 GPUs as 4 nodes x 8, SP 8 inside each stage, pp 4 across nodes.

Llama 7B / 13B / 30B shapes, long-tailed batches of 512 sequences capped at 48K and at 96K tokens
(``synthetic.slimpajama_like``: 30% of documents over 4K, a log-normal tail to the cap), EPP
against seq1f1b and packed-1f1b, every schedule with the same SP 8 inside every stage and model
states sharded over each stage's SP group (ZeRO inside the SP group, as the paper does).  Each
baseline is tuned per batch (packing length, uniform slice count, least uniform checkpointing that
fits).  The paper reports EPP 1.27x (48K) and 1.40x (96K) over Seq1F1B in this setting; its
Seq1F1B uses one static slice count and checkpointing setting, not a per-batch tuned one, so the
table also plans seq1f1b with the slice count fixed at 2, 4 and 8 (``seq1f1b-K<k>``; packing
length and the least uniform checkpointing that fits still tuned).
"""
from __future__ import annotations

from infinipipe_hf.data import synthetic

from .common import fmt_tps, plan_schedules, ratio

NAME = "paper_layout"
DESCRIPTION = "4 nodes x 8 GPUs, sp 8 x pp 4, shard over SP; Llama 7B/13B/30B; 512-seq batches capped at 48K/96K"
MODELS = ("llama2-7b", "llama2-13b", "llama-30b")
CAPS = (48 * 1024, 96 * 1024)
SCHEDULES = ("epp", "seq1f1b", "packed-1f1b")
FIXED_SLICES = (2, 4, 8)
PAPER_EPP_OVER_SEQ1F1B = {48 * 1024: 1.27, 96 * 1024: 1.40}
LAYOUT = dict(pp=4, sp=8, dp=1, shard="sp")


def run(quick: bool, profile=None, memory_gib: float = 80.0) -> dict:
    rows = []
    models = MODELS[:1] if quick else MODELS
    for cap in CAPS:
        lengths = synthetic.slimpajama_like(n=512, max_len=cap, seed=0)
        for model in models:
            plans = plan_schedules(lengths, model, SCHEDULES, memory_gib=memory_gib, profile=profile,
                                   fixed_seq1f1b_slices=FIXED_SLICES, **LAYOUT)
            row = {"model": model, "cap": cap, "num_sequences": len(lengths), "num_tokens": sum(lengths),
                   "longest": max(lengths), "schedules": plans,
                   "epp_over_seq1f1b": ratio(plans["epp"], plans["seq1f1b"]),
                   "epp_over_packed": ratio(plans["epp"], plans["packed-1f1b"]),
                   "epp_over_seq1f1b_fixed": {k: ratio(plans["epp"], plans[f"seq1f1b-K{k}"]) for k in FIXED_SLICES},
                   "paper_epp_over_seq1f1b": PAPER_EPP_OVER_SEQ1F1B[cap]}
            rows.append(row)
            print(_line(row), flush=True)
    return {"layout": {**LAYOUT, "gpus": 32, "gpus_per_node": 8}, "memory_budget_gib": memory_gib,
            "batch": "synthetic.slimpajama_like(n=512, max_len=cap, seed=0)", "rows": rows}


def _line(row: dict) -> str:
    s = row["schedules"]
    r = row["epp_over_seq1f1b"]
    tail = f"epp/seq1f1b={r:.2f}x (paper {row['paper_epp_over_seq1f1b']:.2f}x)" if r else "epp/seq1f1b=n/a"
    return (f"{row['model']:>10} cap {row['cap'] // 1024}K  "
            + "  ".join(f"{k}={fmt_tps(v)}" for k, v in s.items()) + "  " + tail)


def _x(r) -> str:
    return f"{r:.2f}x" if r else "n/a"


def markdown(report: dict) -> str:
    fixed = " | ".join(f"seq1f1b K={k}" for k in FIXED_SLICES)
    lines = [f"| model | cap | EPP tok/s | seq1f1b (tuned) | packed-1f1b | EPP / seq1f1b (paper) | {fixed} | "
             f"EPP / seq1f1b K={'/'.join(map(str, FIXED_SLICES))} | EPP, seq1f1b slices |",
             "|---|---|---|---|---|---|" + "---|" * len(FIXED_SLICES) + "---|---|"]
    for row in report["rows"]:
        s = row["schedules"]
        slices = f"{s['epp'].get('num_slices', '-')}, {s['seq1f1b'].get('num_slices', '-')}"
        fixed_tps = " | ".join(fmt_tps(s[f"seq1f1b-K{k}"]) for k in FIXED_SLICES)
        by_k = {str(k): v for k, v in row["epp_over_seq1f1b_fixed"].items()}  # int keys, or str from JSON
        fixed_x = " / ".join(_x(by_k[str(k)]) for k in FIXED_SLICES)
        lines.append(f"| {row['model']} | {row['cap'] // 1024}K | {fmt_tps(s['epp'])} | {fmt_tps(s['seq1f1b'])} | "
                     f"{fmt_tps(s['packed-1f1b'])} | {_x(row['epp_over_seq1f1b'])} "
                     f"({row['paper_epp_over_seq1f1b']:.2f}x) | {fixed_tps} | {fixed_x} | {slices} |")
    return "\n".join(lines)
