"""Pictures and text of a simulated plan: a Gantt chart of every stage plus its memory curve.

Design: one row per (dp replica, stage); forwards in a blue family, backwards in an orange family,
the shade chosen by the unit's first sequence so a long sequence's slices share a colour and
neighbouring sequences differ; the recompute part of a backward is drawn darker and hatched at its
start (recompute runs before the layer's backward).  Under it, each stage's memory (GiB) over time
with the budget dashed.  Boxes are drawn with ``broken_barh`` per row (one artist per row, not per
box) so a 512-sequence batch with thousands of boxes renders quickly; labels are only written
into boxes wide enough to hold them.

Host copies: with a host tier (the simulation's ``copy_events``) each stage's row keeps its upper
part for compute and draws its copy lane under it: each action's host copies from its start for
their copy (and host CPU) seconds, the exposed part (what the compute did not hide, already in
the action's time) darker and hatched at the end; the step's end (the CPU optimizer's tail) as
one exposed box.

SP rounds: a stage's row is split into lanes by SP rank, and each unit of a round is drawn in the
lanes of its sub-group (a unit on one of eight GPUs takes an eighth of the row), so the round's
units stand side by side and the idle tail of a faster sub-group shows.

Trade-off: colours identify sequences only modulo the palette size; the unit ids are in the
labels and in :func:`format_timeline`'s text, which is exact.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from infinipipe_hf.planner.cost.model import GIB

if TYPE_CHECKING:  # imported lazily so the planner never pulls matplotlib in
    from infinipipe_hf.ir.plan import Plan
    from infinipipe_hf.planner.cost.model import CostModel
    from infinipipe_hf.planner.simulate.result import SimulationResult

RECOMPUTE_COLOUR = (0.35, 0.1, 0.0, 0.55)
COPY_COLOUR = (0.2, 0.6, 0.55, 0.8)
EXPOSED_COPY_COLOUR = (0.7, 0.05, 0.1, 0.75)
COMPUTE_LANE, COPY_LANE = (-0.4, 0.55), (0.2, 0.2)
"""y offset and height in a stage's row of its compute and its copy lane, when it has copies."""


def plot_plan(plan: "Plan", sim: "SimulationResult", path: str, *, title: str | None = None,
              cost: "CostModel | None" = None) -> dict:
    """Write a Gantt + memory PNG (or any matplotlib format, by ``path``'s suffix) of ``plan``.

    Returns what was drawn: ``boxes`` (action boxes per Gantt row), ``recompute_boxes``,
    ``labels`` (boxes wide enough to carry their action's name), ``copy_boxes`` (host copy boxes
    per Gantt row, none without a host tier) and ``exposed_copy_boxes``, ``memory_curves`` and
    ``size_px`` (width, height) of the image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, dp = plan.pp_degree, plan.dp_degree
    rows = p * dp
    fig_w = 14.0
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(fig_w, 2.2 + 0.45 * rows + 2.6), sharex=True,
                                  gridspec_kw={"height_ratios": [max(1.5, 0.45 * rows), 2.6]})
    step = sim.step_time_s or 1.0
    boxes, recompute, labels = _gantt_boxes(plan, sim, step)
    copies = _copy_boxes(plan, sim)
    _draw_gantt(ax, plan, sim, boxes, recompute, labels)
    _draw_copies(ax, copies)
    fig.suptitle(plot_title(plan, sim, title), fontsize=11)
    _draw_memory(axm, sim, p, step)
    fig.tight_layout()
    dpi = 120
    fig.savefig(path, dpi=dpi)
    size = tuple(int(round(x * dpi)) for x in fig.get_size_inches())
    plt.close(fig)
    counts: dict[int, int] = {}
    for (row, _kind, _lane), (spans, _) in boxes.items():
        counts[row] = counts.get(row, 0) + len(spans)
    return {"boxes": counts, "recompute_boxes": sum(len(v) for v in recompute.values()),
            "labels": len(labels), "copy_boxes": {row: len(c[0]) for row, c in copies.items()},
            "exposed_copy_boxes": sum(len(c[1]) for c in copies.values()), "memory_curves": sum(1 for pts in sim.memory_timeline.values() if pts),
            "size_px": size}


def plot_title(plan: "Plan", sim: "SimulationResult", title: str | None = None) -> str:
    """``title`` (which names the layout itself) or ``<schedule> plan: pp=.. dp=..``, then the
    plan's facts once."""
    head = title or f"{plan.schedule} plan: pp={plan.pp_degree} dp={plan.dp_degree}"
    rounds = f" in {len(plan.rounds)} SP rounds" if plan.sp_groups else ""
    return (f"{head}\n{len(plan.sequences)} sequences, {len(plan.units)} units{rounds}, {plan.num_pipelines} "
            f"pipeline(s); step {sim.step_time_s * 1e3:.1f} ms, bubbles {sim.bubble_fraction:.1%}, "
            f"recompute {sim.recompute_time_s * 1e3:.1f} ms")


def format_gib(gib: float) -> str:
    """GiB with three significant digits: 80, 0.01, 1.5 (never a budget of '0.0')."""
    return f"{gib:.3g}"


def _gantt_boxes(plan: "Plan", sim: "SimulationResult", step: float):
    """Per (row, action kind, lane) the spans and colours of its boxes, per (row, lane) the
    recompute spans, and the labels of boxes wide enough to hold them (a lane: the y extent of
    a unit's SP sub-group in its stage's row, the whole row without rounds)."""
    from matplotlib import colormaps

    from infinipipe_hf.ir.actions import Action

    p = plan.pp_degree
    fwd_cmap, bwd_cmap = colormaps["Blues"], colormaps["Oranges"]
    by_id = plan.unit_by_id

    def shade(uid: int) -> float:
        unit = by_id.get(uid)
        seq = unit.segments[0].seq if unit else uid
        return 0.45 + 0.4 * ((seq * 0.618034) % 1.0)  # golden-ratio spread: neighbours differ

    min_label_w = step * 0.012 * max(1, len(str(max(by_id, default=0))))
    top, height = COMPUTE_LANE if sim.copy_events else (-0.4, 0.8)
    boxes: dict[tuple[int, str, tuple[float, float]], tuple[list, list]] = {}
    recompute: dict[tuple[int, tuple[float, float]], list] = {}
    labels = []
    for e in sim.events:
        row = e.dp_rank * p + e.stage
        a = Action.parse(e.action)
        g = plan.sub_group(a.unit)  # the unit's lanes: its sub-group's share of the stage's row
        lane = (row + top + height * g.offset / plan.sp_degree, height * g.size / plan.sp_degree)
        spans, colours = boxes.setdefault((row, a.kind, lane), ([], []))
        spans.append((e.start_s, e.end_s - e.start_s))
        colours.append((fwd_cmap if a.is_forward else bwd_cmap)(shade(a.unit)))
        if e.recompute_s > 0:
            recompute.setdefault((row, lane), []).append((e.start_s, e.recompute_s))
        if e.end_s - e.start_s >= min_label_w and g.size * 4 >= plan.sp_degree:
            labels.append(((e.start_s + e.end_s) / 2, lane[0] + lane[1] / 2, e.action))
    return boxes, recompute, labels


def _copy_boxes(plan: "Plan", sim: "SimulationResult") -> dict[int, tuple[list, list]]:
    """Per Gantt row, the spans of its host copy boxes and of their exposed parts."""
    out: dict[int, tuple[list, list]] = {}
    for e in sim.copy_events:
        spans, exposed = out.setdefault(e.dp_rank * plan.pp_degree + e.stage, ([], []))
        spans.append((e.start_s, e.end_s - e.start_s))
        if e.exposed_s > 0:
            exposed.append((e.end_s - e.exposed_s, e.exposed_s))
    return out


def _draw_copies(ax, copies: dict) -> None:
    """Each stage's copy lane under its compute lane."""
    for row, (spans, exposed) in copies.items():
        lane = (row + COPY_LANE[0], COPY_LANE[1])
        ax.broken_barh(spans, lane, facecolors=COPY_COLOUR, edgecolor="none")
        if exposed:
            ax.broken_barh(exposed, lane, facecolors=EXPOSED_COPY_COLOUR, edgecolor="black", linewidth=0.0,
                           hatch="xxxx")


def _draw_gantt(ax, plan: "Plan", sim: "SimulationResult", boxes: dict, recompute: dict, labels: list) -> None:
    from matplotlib import colormaps
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch

    p, dp = plan.pp_degree, plan.dp_degree
    rows = p * dp
    fwd_cmap, bwd_cmap = colormaps["Blues"], colormaps["Oranges"]
    thin = len(sim.events) > 400
    for (_row, _kind, lane), (spans, colours) in boxes.items():
        ax.broken_barh(spans, lane, facecolors=colours, edgecolor="white" if not thin else "none",
                       linewidth=0.3)
    for (_row, lane), spans in recompute.items():
        ax.broken_barh(spans, lane, facecolors=RECOMPUTE_COLOUR, edgecolor="black",
                       linewidth=0.0, hatch="////")
    for x, y, text in labels:
        ax.text(x, y, text, ha="center", va="center", fontsize=7, color="black")
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"dp{r} stage {s}" if dp > 1 else f"stage {s}" for r in range(dp) for s in range(p)])
    ax.set_ylim(rows - 0.5, -0.5)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    shades = (0.45, 0.65, 0.85)
    handles = [tuple(Patch(color=fwd_cmap(x)) for x in shades), tuple(Patch(color=bwd_cmap(x)) for x in shades),
               Patch(facecolor=RECOMPUTE_COLOUR, hatch="////")]
    names = ["forward", "backward", "recompute"]
    if sim.copy_events:
        handles += [Patch(color=COPY_COLOUR), Patch(facecolor=EXPOSED_COPY_COLOUR, hatch="xxxx")]
        names += ["host copy", "exposed copy"]
    ax.legend(handles=handles, labels=names,
              handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, title="shade: sequence (its slices share one)",
              title_fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=len(names),
              frameon=False)


def _draw_memory(axm, sim: "SimulationResult", p: int, step: float) -> None:
    """Each stage's memory (GiB) over the step, the budget dashed."""
    from matplotlib import colormaps

    stage_colours = colormaps["viridis"]
    for (r, s), pts in sorted(sim.memory_timeline.items()):
        if not pts:
            continue
        xs = [t for t, _ in pts] + [step]
        ys = [b / GIB for _, b in pts] + [pts[-1][1] / GIB]
        axm.step(xs, ys, where="post", linewidth=1.0, color=stage_colours(s / max(1, p - 1) * 0.9),
                 label=f"stage {s}" if r == 0 else None, alpha=1.0 if r == 0 else 0.5)
    budget = sim.memory_budget_bytes / GIB
    axm.axhline(budget, linestyle="--", color="red", linewidth=1.0, label=f"budget {format_gib(budget)} GiB")
    peak = max(sim.peak_memory_bytes, default=0.0) / GIB
    axm.set_ylim(0, max(budget, peak) * 1.1 or 1.0)
    axm.set_ylabel("memory (GiB)")
    axm.set_xlabel("time (s)")
    axm.set_xlim(0, step)
    axm.grid(linewidth=0.3, alpha=0.5)
    axm.legend(loc="lower right", fontsize=8, ncol=min(6, p + 1), framealpha=0.9)


def format_timeline(sim: "SimulationResult", *, max_events_per_stage: int = 40) -> str:
    """Text timeline: summary line (and the host copies' totals), then per (dp, stage) its actions
    with start/end in ms (and its host copies' seconds, exposed part in brackets)."""
    lines = [f"step {sim.step_time_s * 1e3:.3f} ms, {sim.tokens_per_s:,.0f} tokens/s, bubbles "
             f"{sim.bubble_fraction:.1%}, recompute {sim.recompute_time_s * 1e3:.3f} ms, "
             f"{'feasible' if sim.feasible else 'OVER MEMORY BUDGET'}"]
    lines += [line] if (line := format_host_copies(sim)) else []
    lanes = sim.copy_lanes()
    rows: dict[tuple[int, int], list] = {}
    for e in sim.events:
        rows.setdefault((e.dp_rank, e.stage), []).append(e)
    for (r, s), events in sorted(rows.items()):
        events.sort(key=lambda e: e.start_s)
        peak = sim.peak_memory_bytes[s] / GIB if s < len(sim.peak_memory_bytes) else float("nan")
        cells = [f"{e.action}@{e.start_s * 1e3:.2f}-{e.end_s * 1e3:.2f}"
                 + (f"(rc {e.recompute_s * 1e3:.2f})" if e.recompute_s > 0 else "")
                 for e in events[:max_events_per_stage]]
        more = f" ... (+{len(events) - max_events_per_stage} more)" if len(events) > max_events_per_stage else ""
        lane = lanes.get((r, s), [])
        copies = (f"; host copies {sum(e.copy_s for e in lane) * 1e3:.2f} ms "
                  f"(exposed {sum(e.exposed_s for e in lane) * 1e3:.2f})" if lane else "")
        lines.append(f"dp{r} stage {s} (peak {format_gib(peak)} GiB): " + " ".join(cells) + more + copies)
    return "\n".join(lines)


def format_host_copies(sim) -> str | None:
    """One line of a simulation's host copy totals (None without host copies): the link's seconds
    and bytes and the host CPU's seconds on the same chains (gradient adds, the CPU optimizer) over
    all stages, and the exposed part, which the step time already includes."""
    if not getattr(sim, "copy_events", None):
        return None
    t = sim.copy_totals()
    return (f"host copies: {t['host_copy_s']:.3f} s on the host link ({t['host_copy_bytes'] / GIB:.3g} GiB) and "
            f"{t['host_copy_cpu_s']:.3f} s of host CPU over all stages, {t['host_copy_exposed_s']:.3f} s exposed "
            f"(in the step time)")
