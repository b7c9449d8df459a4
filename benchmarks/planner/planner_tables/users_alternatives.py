"""The systems HF users run instead of a pipeline, on the planner benchmark's batches and GPUs.

The batches and setups of the main planner table (``setups.py``: 512 sequences of real
Python-stdlib lengths, the stdlib + Shakespeare + KJV mix, SlimPajama-like and ProLong-like
synthetic ones to 128K, short ones; Llama-2-7B on 4 GPUs as pp 4, Llama-2-13B on 8 GPUs as pp 8,
one node, 80 GiB): EPP and the best pipeline baseline against ``ulysses-zero3`` (DeepSpeed-Ulysses
+ ZeRO-3), ``ring-cp`` (FSDP2 + ring attention) and ``flexsp`` on the same GPUs, each tuned per
batch over its knobs (chosen knobs shown).  EPP is also planned with Ulysses SP inside its stages on
the same GPUs (every ``pp x sp`` split, states sharded over SP), since a user picks the layout too:
the column "EPP, best pp x sp" is the fastest of those and of plain pp.  At sp > 1 EPP runs with
elastic SP rounds (its default) and again on whole SP groups; the second table compares EPP at its
best layout, with and without rounds, to FlexSP and DeepSpeed-Ulysses + ZeRO-3 on every batch, and
says what the rounds of that layout look like.  Single batches; the 32-GPU, 20-batch comparison is
the paper table.
"""
from __future__ import annotations

from infinipipe_hf.planner.registry import ALTERNATIVES

from .common import WHOLE, plan_schedules, rounds_text
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
            layouts, whole = {}, {}
            for sp in (d for d in (2, 4, 8) if pp % d == 0):
                both = plan_schedules(lengths, model, ("epp",), pp=pp // sp, sp=sp, shard="sp", memory_gib=memory_gib,
                                      profile=profile)
                layouts[f"pp{pp // sp}xsp{sp}"], whole[f"pp{pp // sp}xsp{sp}"] = both["epp"], both[WHOLE]
            row = {"model": model, "gpus": pp, "batch": name, "num_tokens": sum(lengths), "longest": max(lengths),
                   "schedules": plans, "epp_sp_layouts": layouts, "epp_sp_layouts_whole_groups": whole}
            rows.append({**row, "best_layout": _best_layouts(row)})
            print(f"  {model} {pp} GPUs {name:<26} " + "  ".join(f"{k}={fmt_k(v['tokens_per_s'])}"
                                                                  for k, v in plans.items()), flush=True)
    return {"memory_budget_gib": memory_gib, "rows": rows, "summary": _summary(rows)}


def _fastest(layouts: dict) -> tuple[str, dict]:
    return max(layouts.items(), key=lambda kv: kv[1]["tokens_per_s"] if kv[1]["feasible"] else 0.0)


def _best_layouts(row: dict) -> dict:
    """EPP at its fastest layout with rounds and on whole SP groups, against FlexSP and DeepSpeed."""
    s = row["schedules"]
    plain = {f"pp{row['gpus']}xsp1": s["epp"]}
    out = {}
    for key, layouts in (("rounds", {**plain, **row["epp_sp_layouts"]}),
                         ("whole_groups", {**plain, **row["epp_sp_layouts_whole_groups"]})):
        where, top = _fastest(layouts)
        tps = top["tokens_per_s"] if top["feasible"] else 0.0
        out[key] = {"layout": where, "tokens_per_s": tps, "rounds": rounds_text(top)}
        for alt in ("flexsp", "ulysses-zero3"):
            other = s[alt]["tokens_per_s"] if s[alt]["feasible"] else 0.0
            out[key][f"over_{alt}"] = tps / other if tps and other else None
    return out


def _summary(rows: list[dict]) -> dict:
    """Whether EPP at its best layout (with rounds) is at least as fast as FlexSP and DeepSpeed on
    every batch, and the worst ratios with and without rounds."""
    out = {}
    for key in ("rounds", "whole_groups"):
        for alt in ("flexsp", "ulysses-zero3"):
            xs = [r["best_layout"][key][f"over_{alt}"] for r in rows]
            known = [x for x in xs if x is not None]
            out[f"{key}_over_{alt}_min"] = min(known, default=None)
            out[f"{key}_at_least_{alt}_every_batch"] = all(x is None or x >= 1.0 for x in xs)
    return out


LABELS = {"sp_degree": "sp", "cp_degree": "cp", "pack_tokens": "pack", "num_rounds": "rounds",
          "checkpoint_layers": "ckpt"}


def _knobs(s: dict) -> str:
    return ", ".join(f"{label} {s[k]}" for k, label in LABELS.items() if k in s)


def markdown(report: dict) -> str:
    return _markdown_alternatives(report) + "\n\n" + _markdown_rounds(report)


def _x(v) -> str:
    return f"{v:.2f}x" if v else "n/a"


def _markdown_rounds(report: dict) -> str:
    lines = ["| model, GPUs | batch | EPP best layout, rounds | EPP best layout, whole groups | FlexSP | DeepSpeed | "
             "EPP / FlexSP (rounds / whole) | EPP / DeepSpeed (rounds / whole) | rounds at the best layout |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if "best_layout" not in row:
            continue
        s, r, w = row["schedules"], row["best_layout"]["rounds"], row["best_layout"]["whole_groups"]
        lines.append(f"| {row['model']}, {row['gpus']} | {row['batch']} | {fmt_k(r['tokens_per_s'])} ({r['layout']}) | "
                     f"{fmt_k(w['tokens_per_s'])} ({w['layout']}) | {fmt_k(s['flexsp']['tokens_per_s'])} | "
                     f"{fmt_k(s['ulysses-zero3']['tokens_per_s'])} | {_x(r['over_flexsp'])} / {_x(w['over_flexsp'])} | "
                     f"{_x(r['over_ulysses-zero3'])} / {_x(w['over_ulysses-zero3'])} | {r['rounds']} |")
    g = report.get("summary")
    if g:
        lines.append(f"| worst | | | | | | {_x(g['rounds_over_flexsp_min'])} / {_x(g['whole_groups_over_flexsp_min'])} | "
                     f"{_x(g['rounds_over_ulysses-zero3_min'])} / {_x(g['whole_groups_over_ulysses-zero3_min'])} | |")
    return "\n".join(lines)


NAMES = {"ulysses-zero3": "DeepSpeed-Ulysses + ZeRO-3", "ring-cp": "FSDP2 ring CP", "flexsp": "FlexSP"}


def _markdown_alternatives(report: dict) -> str:
    planned = [k for k in ALTERNATIVES if all(k in row["schedules"] for row in report["rows"])]
    lines = ["| model, GPUs | batch | EPP (pp = GPUs) | EPP, best pp x sp | best pipeline baseline | "
             + " | ".join(NAMES.get(k, k) for k in planned) + " | EPP / best alternative (best pp x sp) |",
             "|" + "---|" * (6 + len(planned))]
    for row in report["rows"]:
        s = row["schedules"]
        base = max(("packed-1f1b", "seq1f1b"), key=lambda k: s[k]["tokens_per_s"])
        alts = {k: s[k]["tokens_per_s"] for k in planned}
        best_alt = max(alts.values())
        epp = s["epp"]["tokens_per_s"]
        ratio = f"{epp / best_alt:.2f}x" if epp and best_alt else ("only EPP fits" if epp else "n/a")
        layouts = {f"pp{row['gpus']}xsp1": s["epp"], **row.get("epp_sp_layouts", {})}
        where, top = max(layouts.items(), key=lambda kv: kv[1]["tokens_per_s"] or 0.0)
        best_epp = top["tokens_per_s"] or 0.0
        if best_epp and best_alt:
            ratio += f" ({best_epp / best_alt:.2f}x)"
        cells = [f"{fmt_k(s[k]['tokens_per_s'])}" + (f" ({_knobs(s[k])})" if s[k]["feasible"] else "")
                 for k in planned]
        lines.append(f"| {row['model']}, {row['gpus']} | {row['batch']} | {fmt_k(epp)} | {fmt_k(best_epp)} ({where}) | "
                     f"{fmt_k(s[base]['tokens_per_s'])} ({base}) | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)
