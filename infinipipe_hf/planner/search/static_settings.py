"""One knob setting for a whole run: the best *static* configuration of a schedule over many batches.

Tuning per batch (what ``plan_step`` and ``plan_alternative`` do) is the most a baseline could
get; real runs fix their configuration once: Seq1F1B one slice count and one checkpoint setting,
DeepSpeed one SP degree and micro-batch length, torchtitan one CP degree.  Here every setting a
schedule could be launched with is tried on *all* batches of a run, with one checkpoint count for
the run (the largest any batch needs: fewer would not fit that batch; a setting where that count
does not fit some batch -- checkpointing one layer first costs the memory of its rebuild -- is
out), and the setting with the least total step time wins.  A packing length ``2^k`` packs each
batch at ``max(its longest, 2^k)`` (packing never cuts a sequence).  Throughput is total tokens over total time.

- pipeline baselines (:func:`static_pipeline_baseline`, ``seq1f1b`` / ``packed-1f1b``): settings
  ``(2^k packing length, slice count)``; a batch packs at ``max(its longest, 2^k)`` (packing never
  cuts a sequence).  The per-batch tuned results already hold every setting's step time at its own
  least uniform count; settings are ranked by that total (a lower bound: more checkpointing is
  never faster) and only batches needing less than the run's count are re-simulated, until the
  next bound cannot win.
- non-pipeline alternatives (:func:`static_alternative`): ``ulysses-zero3`` over
  ``(sp_degree, 2^k)``, ``ring-cp`` over ``cp_degree``, ``flexsp`` over its checkpoint count (its
  groups are re-solved every step by design).

Trade-off: the grids are the per-batch grids, so a static setting is never luckier than tuning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.flexsp import checkpoint_grid, plan_flexsp
from infinipipe_hf.planner.alternatives.ring_cp import build_ring_cp
from infinipipe_hf.planner.alternatives.round_plan import simulate_rounds
from infinipipe_hf.planner.alternatives.ulysses_zero3 import UlyssesBuilder
from infinipipe_hf.planner.batch.uniform import MIN_PACK_LOG2
from infinipipe_hf.planner.cost.model import CostModel


@dataclass
class StaticResult:
    """The best single setting of a schedule over a run's batches."""

    schedule: str
    feasible: bool
    """Some setting fits every batch."""
    knobs: dict = field(default_factory=dict)
    """The setting (with ``checkpoint_layers``, the run's uniform count)."""
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    """Total tokens of the run over total step time."""
    settings_tried: int = 0
    error: str | None = None

    def summary(self) -> dict:
        d = {"schedule": self.schedule, "feasible": self.feasible, "knobs": dict(self.knobs),
             "tokens_per_s": self.tokens_per_s, "step_times_s": list(self.step_times_s),
             "settings_tried": self.settings_tried}
        if self.error:
            d["error"] = self.error
        return d


def _pack_exponents(batches: Sequence[Sequence[int]], sp_degree: int) -> range:
    low = MIN_PACK_LOG2 + (int(sp_degree) - 1).bit_length()
    top = min(sum(b).bit_length() - 1 for b in batches)
    return range(low, max(low, top) + 1)


def _pack_knob(e: int, batches: Sequence[Sequence[int]]) -> int | str:
    """The packing length a setting ``2^e`` amounts to: ``"longest"`` when every batch packs at
    its longest sequence (``2^e`` at most the shortest of the batches' longest)."""
    return "longest" if (1 << e) <= min(max(b) for b in batches) else 1 << e


def _finish(schedule, batches, best, tried, error) -> StaticResult:
    if best is None:
        return StaticResult(schedule, False, settings_tried=tried,
                            error=error or f"{schedule}: no single setting fits every batch of the run")
    total, knobs, times = best
    tokens = sum(sum(b) for b in batches)
    return StaticResult(schedule, True, knobs, times, tokens / total, tried)


# --- pipeline baselines ---------------------------------------------------------------------
def static_pipeline_baseline(schedule: str, batches: Sequence[Sequence[int]], tuned: Sequence, cost: CostModel,
                             num_slices: int | None = None) -> StaticResult:
    """Best static ``(packing length, slice count, checkpoint count)`` of ``seq1f1b`` or
    ``packed-1f1b``, from the per-batch tuned ``PlanResult`` s of the same ``cost`` (module docstring).
    ``num_slices`` fixes seq1f1b's slice count (the setting Seq1F1B is usually run with)."""
    from infinipipe_hf.planner.schedules.candidates import baseline_plan  # lazy: the pipeline planner is heavy
    from infinipipe_hf.planner.batch.dp_assign import assign_sequences
    from infinipipe_hf.planner.simulate.simulator import simulate

    if schedule not in ("seq1f1b", "packed-1f1b", "gpipe"):
        raise ValueError(f"schedule={schedule!r} has no static packing setting; use seq1f1b, packed-1f1b or gpipe")
    if len(tuned) != len(batches):
        raise ValueError(f"got {len(tuned)} tuned results for {len(batches)} batches; pass one per batch")
    records = []
    for res in tuned:
        recs = {}
        for c in res.candidates:
            if c.get("feasible") and "checkpoint_layers" in c:
                recs[(int(c["pack_tokens"]), int(c.get("num_slices", 1)))] = c
        records.append(recs)
    slices = sorted({k for recs in records for _, k in recs})
    if num_slices is not None:
        if num_slices not in slices:
            return StaticResult(schedule, False, error=f"{schedule}: the tuned results hold no plan with "
                                                      f"num_slices={num_slices}; tune over a grid that has it")
        slices = [num_slices]
    settings = []
    for e in _pack_exponents(batches, cost.sp_degree):
        for k in slices:
            rows = [recs.get((max(max(b), 1 << e), k)) for b, recs in zip(batches, records)]
            if all(rows):
                lower = sum(r["step_time_s"] for r in rows)
                settings.append((lower, e, k, rows))
    settings.sort(key=lambda s: s[0])
    best, tried = None, 0
    for lower, e, k, rows in settings:
        if best is not None and lower >= best[0]:
            break
        tried += 1
        run_c = max(int(r["checkpoint_layers"]) for r in rows)
        times = []
        for lengths, r in zip(batches, rows):
            if int(r["checkpoint_layers"]) == run_c:
                times.append(r["step_time_s"])
                continue
            lengths = [int(n) for n in lengths]
            replicas = assign_sequences(lengths, cost.dp_degree, cost)
            plan = baseline_plan(lengths, replicas, cost, schedule, int(r["pack_tokens"]), k, "uniform")
            plan.checkpoint_layers = {s: {u: min(run_c, cost.layers_per_stage[s]) for u in per}
                                      for s, per in plan.checkpoint_layers.items()}
            sim = simulate(plan, cost)
            if not sim.feasible:  # one checkpointed layer more can cost memory (its rebuild in backward)
                times = None
                break
            times.append(sim.step_time_s)
        if times is None:
            continue
        total = sum(times)
        if best is None or total < best[0]:
            knobs = {"pack_log2": e, "pack_tokens": _pack_knob(e, batches), "checkpoint_layers": run_c}
            if schedule == "seq1f1b":
                knobs["num_slices"] = k
            best = (total, knobs, times)
    return _finish(schedule, batches, best, tried, None)


# --- non-pipeline alternatives -------------------------------------------------------------
def _run_setting(batches, build, cost: FlatCost):
    """Total time of one setting: each batch at its least count, then all at the run's largest.
    ``build(i, checkpoint)`` plans batch ``i``."""
    first = []
    for i in range(len(batches)):
        try:
            first.append(build(i, None))
        except ValueError as exc:
            return None, str(exc)
    run_c = max(p.checkpoint_layers for p in first)
    times = []
    for i, plan in enumerate(first):
        if plan.checkpoint_layers != run_c:
            plan = build(i, run_c)
        sim = simulate_rounds(plan, cost)
        if not sim.feasible:
            return None, sim.error
        times.append(sim.step_time_s)
    return (sum(times), run_c, times), None


def static_alternative(schedule: str, batches: Sequence[Sequence[int]], cost: FlatCost) -> StaticResult:
    """Best static setting of ``ulysses-zero3``, ``ring-cp`` or ``flexsp`` over ``batches``."""
    batches = [[int(n) for n in b] for b in batches]
    best, tried, error = None, 0, None
    if schedule == "flexsp":
        for c in checkpoint_grid(cost, None):
            tried += 1
            results = [plan_flexsp(b, cost, checkpointing=c) for b in batches]
            if not all(r.feasible for r in results):
                error = next(r.error for r in results if not r.feasible)
                continue
            times = [r.simulation.step_time_s for r in results]
            if best is None or sum(times) < best[0]:
                best = (sum(times), {"checkpoint_layers": c}, times)
        return _finish(schedule, batches, best, tried, error)
    if schedule == "ulysses-zero3":
        settings = [({"sp_degree": sp, "pack_log2": e, "pack_tokens": _pack_knob(e, batches)}, sp, e)
                    for sp in cost.group_sizes("ulysses") for e in _pack_exponents(batches, sp)]
        builders = [UlyssesBuilder(b, cost) for b in batches]  # each caches its packings

        def make(sp, e):
            return lambda i, c: builders[i]({"sp_degree": sp, "pack_tokens": max(max(batches[i]), 1 << e)}, c)
    elif schedule == "ring-cp":
        settings = [({"cp_degree": cp}, cp, None) for cp in cost.group_sizes("ring")]
        ring_builders = [build_ring_cp(b, cost) for b in batches]

        def make(cp, _):
            return lambda i, c: ring_builders[i]({"cp_degree": cp}, c)
    else:
        raise ValueError(f"schedule={schedule!r} is not a non-pipeline alternative; use ulysses-zero3, ring-cp or flexsp")
    for knobs, a, b in settings:
        tried += 1
        got, err = _run_setting(batches, make(a, b), cost)
        if got is None:
            error = err
            continue
        total, run_c, times = got
        if best is None or total < best[0]:
            best = (total, {**knobs, "checkpoint_layers": run_c}, times)
    return _finish(schedule, batches, best, tried, error)
