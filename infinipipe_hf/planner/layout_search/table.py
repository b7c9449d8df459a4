"""The layout search's table: every layout (ranked), the alternatives at their best, the pick.

The planner CLI prints it without ``--json``; the trainer logs it with ``pp_degree="auto"``.
The host tier adds the state-offload mode and the host peak beside the GPU peak, and for a batch
of one sequence each layout's largest trainable length with and without the host tier.
"""
from __future__ import annotations

from infinipipe_hf.planner.cost.calibration import pricing_text
from infinipipe_hf.planner.layout_search.prune import PrunedOutcome
from infinipipe_hf.planner.layout_search.result import (
    LayoutOutcome,
    LayoutSearch,
    flagless,
    gib,
    recipe_flags,
    training_arguments,
)


def _lengths(o: LayoutOutcome) -> str:
    """``largest (no host)`` cell: the largest one-sequence lengths, when searched."""
    if o.largest_length is None:
        return "-"
    return f"{o.largest_length:,} ({o.largest_length_without_offload or 0:,})"


def _row(o: LayoutOutcome, longest: bool) -> tuple[str, ...]:
    lay = o.layout
    head = (lay.label, lay.shard.name, lay.state_offload.name)
    tail = (_lengths(o),) if longest else ()
    note = f"priced as shard {o.priced_as}" if o.priced_as else ""
    if isinstance(o, PrunedOutcome):  # not planned: whether it fits is unknown, its bounds are not
        return (*head, "-", f"<={o.bound_tokens_per_s:,.0f}", f">={o.bound_step_time_s:.4g}", "-", "-", "-", "-",
                f"{o.search_time_s:.2f}", *tail, o.error)
    if not o.feasible:
        return (*head, "NO", "0", "-", "-", "-", "-", "-", f"{o.search_time_s:.2f}", *tail, o.error or note)
    sim = o.result.simulation
    if lay.shard.sharded and o.result.plan is not None and o.result.plan.grad_reduce == "unit":
        note = "; ".join(filter(None, (note, "gradients reduced per unit")))
    return (*head, "yes", f"{o.tokens_per_s:,.0f}", f"{sim.step_time_s:.3f}", gib(o.peak_memory_bytes),
            gib(o.host_peak_memory_bytes), f"{sim.bubble_fraction:.3f}", f"{sim.recompute_fraction:.3f}",
            f"{o.search_time_s:.2f}", *tail, note)


def _alternative_row(name: str, r, longest: bool) -> tuple[str, ...]:
    tail = ("-",) if longest else ()
    if not r.feasible:
        return (name, "(best)", "-", "NO", "0", "-", "-", "-", "-", "-", f"{r.planning_time_s:.2f}", *tail,
                r.error or "")
    sim, knobs, d = r.simulation, dict(r.plan.knobs), r.summary()
    knobs["ckpt"] = r.plan.checkpoint_layers
    return (name, "(best)", d.get("state_offload", "-"), "yes", f"{sim.tokens_per_s:,.0f}", f"{sim.step_time_s:.3f}",
            gib(sim.peak_memory_bytes), gib(d.get("host_peak_memory_bytes") or 0.0), f"{sim.bubble_fraction:.3f}",
            "-", f"{r.planning_time_s:.2f}", *tail, ", ".join(f"{k} {v}" for k, v in knobs.items()))


def _ratio(x: float) -> str:
    """``1.16x``; within half a percent of 1, three decimals, so a lead or a lag never reads 1.00x."""
    return f"{x:.3f}x" if abs(x - 1.0) < 0.005 else f"{x:.2f}x"


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]


def format_search(search: LayoutSearch) -> str:
    """The table of every layout (ranked), the alternatives at their best and the recommendation."""
    longest = any(o.largest_length is not None for o in search.layouts)
    header = ("layout", "shard", "offload", "fits", "tokens/s", "step s", "peak GiB", "host GiB", "bubble",
              "recompute", "plan s", *(("largest (no host)",) if longest else ()), "note")
    rows = [header, *(_row(o, longest) for o in search.layouts),
            *(_alternative_row(n, r, longest) for n, r in search.alternatives.items())]
    host = (f", {gib(search.host_budget_bytes)} GiB host memory per GPU" if search.host_budget_bytes
            else ", no host memory")
    lines = [f"EPP on every layout of {search.world_size} GPUs ({search.gpus_per_node} per node), "
             f"{gib(search.memory_budget_bytes)} GiB per GPU{host}; alternatives on the same GPUs at their best "
             f"knobs; bubble and recompute are shares of the step's GPU time; offload: model states in host memory; "
             f"fits '-': not planned in full, the row shows its bounds"
             + ("; largest: the longest one sequence each layout trains, with the host tier (without)" if longest
                else ""), *_columns(rows)]
    best = search.recommended
    if best is None:
        lines.append(f"no layout fits: {search.extra.get('error', '')}")
    else:
        lay = best.layout
        offload = f", state offload {lay.state_offload}" if lay.state_offload.offloaded else ""
        lines.append(f"recommended: {lay.label}, shard {lay.shard}{offload}: {best.tokens_per_s:,.0f} tokens/s, peak "
                     f"{gib(best.peak_memory_bytes)} GiB per GPU, host peak {gib(best.host_peak_memory_bytes)} GiB")
        if lay.shard.sharded and best.result.plan is not None:
            per_unit = best.result.plan.grad_reduce == "unit"
            lines.append(f"  sharded gradients reduced {'after every unit' if per_unit else 'once per step'} "
                         f"(--grad-reduce {best.result.plan.grad_reduce})")
        whole = search.without_sp_rounds
        if whole is not None:
            lines.append(f"  with elastic SP rounds; without them (--no-sp-rounds) this layout plans "
                         f"{whole.summary()['tokens_per_s']:,.0f} tokens/s")
        rec = search.recommended_dict()
        for name, ratio in rec["over_alternatives"].items():
            lines.append(f"  {_ratio(ratio)} {name} at its best")
        if rec["behind_alternatives"]:
            behind = ", ".join(f"{n} ({_ratio(r)})" for n, r in rec["behind_alternatives"].items())
            lines.append(f"  behind {behind} on this batch: the alternative at its best is faster than EPP's "
                         f"best layout here")
        settings = search.recommended_settings()
        lines += [f"  EPPTrainingArguments({training_arguments(lay, settings)}, ...)",
                  f"  recipe flags: {recipe_flags(lay, settings)} (recipes/train.py; launch {search.world_size} "
                  f"processes)"]
        if flagless(settings):
            lines.append(f"  (no command-line form for {', '.join(flagless(settings))}: set it in Python)")
        if "plan_command" in search.extra:
            lines.append(f"  replan it alone: {search.extra['plan_command']}")
    if "pricing" in search.extra:
        lines.append(pricing_text(search.extra["pricing"]))
    lines.append(f"tie-break: {search.tie_break}")
    planned = sum(o.result is not None and o.priced_as is None for o in search.layouts)
    lines.append(f"search: {len(search.layouts)} layouts, {planned} planned, {search.search_time_s:.1f} s")
    return "\n".join(lines)
