"""The best static setting of a pipeline baseline over a run (see :mod:`.static_common`).

Settings are a ``2^k`` packing length and, for seq1f1b, a slice count and slice balance.  The
per-batch tuned results already hold every setting's step time at its own least uniform checkpoint
count; settings are ranked by that total (a lower bound: more checkpointing is never faster) and
only batches needing less than the run's count are re-simulated, until the next bound cannot win.
"""
from __future__ import annotations

from typing import Sequence

from benchmarks.lib.static_common import StaticResult, static_result
from infinipipe_hf.planner.batch.dp_assign import assign_sequences
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.grids import run_pack_exponents, run_pack_knob
from infinipipe_hf.planner.registry import PIPELINE_SCHEDULES, SCHEDULES
from infinipipe_hf.planner.schedules.base import PIPELINE
from infinipipe_hf.planner.schedules.baseline import PackKnobs
from infinipipe_hf.planner.simulate.simulator import simulate


def static_pipeline_baseline(schedule: str, batches: Sequence[Sequence[int]], tuned: Sequence, cost: CostModel,
                             num_slices: int | None = None) -> StaticResult:
    """Best static ``(packing length, slicing, checkpoint count)`` of a pipeline baseline such as
    ``seq1f1b`` or ``packed-1f1b``, from the per-batch tuned ``PlanResult`` s of the same ``cost``
    (module docstring).  ``num_slices`` fixes seq1f1b's slice count (the setting Seq1F1B is usually
    run with); its slice balance is one setting of the run too."""
    sched = SCHEDULES.get(schedule)
    if sched is None or sched.kind != PIPELINE or not sched.static_packing:
        names = [n for n in PIPELINE_SCHEDULES if SCHEDULES[n].static_packing]
        raise ValueError(f"schedule={schedule!r} has no static packing setting; use {', '.join(names[:-1])} "
                         f"or {names[-1]}")
    if len(tuned) != len(batches):
        raise ValueError(f"got {len(tuned)} tuned results for {len(batches)} batches; pass one per batch")
    records = _tuned_records(tuned)
    slicings = sorted({s for recs in records for _, s in recs}, key=lambda s: (s[0] or 1, s[1] or ""))
    if num_slices is not None:
        slicings = [s for s in slicings if (s[0] or 1) == num_slices]
        if not slicings:
            return StaticResult(schedule, False, error=f"{schedule}: the tuned results hold no plan with "
                                                      f"num_slices={num_slices}; tune over a grid that has it")
    best, tried = None, 0
    for lower, e, slicing, rows in _settings(batches, records, slicings, cost.dims.sp_degree):
        if best is not None and lower >= best[0]:
            break
        tried += 1
        run_c = max(int(r["checkpoint_layers"]) for r in rows)
        times = _run_times(sched, batches, rows, run_c, cost)
        if times is None:
            continue
        total = sum(times)
        if best is None or total < best[0]:
            knobs = {"pack_log2": e, "pack_tokens": run_pack_knob(e, batches), "checkpoint_layers": run_c,
                     **{k: v for k, v in zip(("num_slices", "slice_balance"), slicing) if v is not None}}
            best = (total, knobs, times)
    return static_result(schedule, batches, best, tried, None)


def _tuned_records(tuned: Sequence) -> list[dict]:
    """Per batch: its feasible tuned candidates by ``(pack_tokens, (num_slices, slice_balance))``."""
    records = []
    for res in tuned:
        recs = {}
        for c in res.candidates:
            if c.get("feasible") and "checkpoint_layers" in c:
                k = PackKnobs.from_record(c)
                recs[(k.pack_tokens, (k.num_slices, k.slice_balance))] = c
        records.append(recs)
    return records


def _settings(batches, records, slicings, sp_degree) -> list[tuple]:
    """``(lower bound, pack exponent, slicing, tuned rows)`` of every setting every batch has,
    lowest bound first."""
    settings = []
    for e in run_pack_exponents(batches, sp_degree):
        for slicing in slicings:
            rows = [recs.get((max(max(b), 1 << e), slicing)) for b, recs in zip(batches, records)]
            if all(rows):
                lower = sum(r["step_time_s"] for r in rows)
                settings.append((lower, e, slicing, rows))
    settings.sort(key=lambda s: s[0])
    return settings


def _run_times(sched, batches, rows, run_c: int, cost: CostModel) -> list[float] | None:
    """Each batch's step time at the run's checkpoint count ``run_c`` (None: some batch does not fit)."""
    times = []
    for lengths, r in zip(batches, rows):
        if int(r["checkpoint_layers"]) == run_c:
            times.append(r["step_time_s"])
            continue
        lengths = [int(n) for n in lengths]
        replicas = assign_sequences(lengths, cost.dims.dp_degree, cost)
        try:
            plan = sched.plan(lengths, replicas, cost, PackKnobs.from_record(r), "uniform")
        except ValueError:  # no uniform count of this setting fits this batch: the run cannot use it
            return None
        plan.checkpoint_layers = {s: {u: min(run_c, cost.layers_per_stage[s]) for u in per}
                                  for s, per in plan.checkpoint_layers.items()}
        sim = simulate(plan, cost)
        if not sim.feasible:  # one checkpointed layer more can cost memory (its rebuild in backward)
            return None
        times.append(sim.step_time_s)
    return times
