"""``plan_step``: one global batch of sequence lengths in, the best validated plan out.

This is the glue of the planner (docs/algorithms.md): for each candidate slice count K (EPP) or tuning knob
(baselines) it builds units, assigns sequences to DP replicas, groups units into pipelines,
orders actions, solves checkpointing, simulates, and keeps the fastest plan that fits memory.
Every schedule goes through the same cost model, solver and simulator, so EPP and the baselines
are compared on equal terms; each baseline is tuned over its own knob (packing length, uniform
slice count) with the least uniform checkpointing that fits.

With sequence parallelism a stage is ``sp_degree`` GPUs sharing each unit, so units may be
``sp_degree`` times longer for the same per-GPU work: the slice-count grid keeps slices of at
least ``MIN_SLICE_TOKENS`` tokens *per GPU*, packing floors scale with ``sp_degree``, and every
time and byte comes per GPU from the cost model.  Every schedule is planned with the same SP
degree and sharding inside its stages.

Searching is the trade-off: a handful of candidates per batch costs milliseconds each and buys
robustness against a cost model that is only approximately right about where the optimum lies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from infinipipe_hf.planner.schedules.candidates import (DEFAULT_SLICE_COUNTS, EXACT_CANDIDATES,
    baseline_candidates, epp_candidates)
from infinipipe_hf.ir.levels import FINER_LEVELS, check_levels
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.batch.dp_assign import assign_sequences
from infinipipe_hf.planner.cost.profile import HardwareProfile
from infinipipe_hf.planner.search.limits import largest_trainable_length
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.simulate.simulator import SimulationResult, simulate
from infinipipe_hf.planner.simulate.validator import validate

SCHEDULES = ("epp", "packed-1f1b", "seq1f1b", "gpipe")


@dataclass
class PlanResult:
    """The outcome of planning one step with one schedule."""

    schedule: str
    plan: Plan | None
    simulation: SimulationResult | None
    feasible: bool
    error: str | None
    planning_time_s: float
    candidates: list[dict] = field(default_factory=list)
    """One entry per configuration tried: knob values, step time, feasibility."""
    sp_degree: int = 1
    """GPUs per stage the plan (or the failed search) was costed for."""
    shard: str = "none"
    """Model-state sharding the plan (or the failed search) was costed for."""

    def summary(self) -> dict:
        """The ``--json`` object of the planner CLI (docs/contracts.md)."""
        sim = self.simulation
        plan = self.plan
        d = {
            "schedule": self.schedule,
            "feasible": self.feasible,
            "step_time_s": sim.step_time_s if sim else None,
            "tokens_per_s": sim.tokens_per_s if sim and self.feasible else 0.0,
            "bubble_fraction": sim.bubble_fraction if sim else None,
            "peak_memory_bytes": list(sim.peak_memory_bytes) if sim else None,
            "memory_budget_bytes": sim.memory_budget_bytes if sim else None,
            "recompute_time_s": sim.recompute_time_s if sim else None,
            "recompute_fraction": sim.recompute_fraction if sim else None,
            "num_pipelines": plan.num_pipelines if plan else 0,
            "num_units": len(plan.units) if plan else 0,
            "num_tokens": plan.num_tokens if plan else None,
            "planning_time_s": self.planning_time_s,
            "sp_degree": self.sp_degree,
            "shard": self.shard,
        }
        if plan is not None:
            d["layers_per_stage"] = list(plan.layers_per_stage)
            d["info"] = dict(plan.info)
        if self.error:
            d["error"] = self.error
        return d


def check_batch(lengths: Sequence[int]) -> None:
    if len(lengths) == 0:
        raise ValueError("empty batch: plan_step needs at least one sequence; check that the data "
                         "loader yields non-empty batches")
    for i, n in enumerate(lengths):
        if int(n) != n or n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs at least 1 token "
                             f"(drop empty documents before planning)")


def plan_step(lengths: Sequence[int], spec: ModelSpec, *, pp_degree: int, dp_degree: int = 1,
              schedule: str = "epp", memory_budget_bytes: float | None = None,
              profile: HardwareProfile | None = None, layers_per_stage: Sequence[int] | None = None,
              max_tokens_per_unit: int | None = None, num_slices: Sequence[int] | None = None,
              checkpointing: str = "adaptive", loss_chunk_tokens: int = 4096,
              solver_time_limit_s: float = 0.25, cost: CostModel | None = None, sp_degree: int = 1,
              shard: str = "none", gpus_per_node: int | None = None,
              checkpoint_levels: Sequence[str] = FINER_LEVELS, checkpoint_sharing: str = "cell") -> PlanResult:
    """Plan one training step of ``lengths`` (one global batch) with ``schedule``.

    ``sp_degree``, ``shard`` and ``gpus_per_node`` describe the layout (see ``CostModel``); a
    ``cost`` passed in must have been built for the same degrees and sharding.  ``num_slices``
    restricts the slice counts searched: of the longest sequence for EPP, the uniform one for
    seq1f1b (a static setting; its packing length and checkpointing are still tuned).
    ``solver_time_limit_s`` bounds the adaptive-checkpointing MILP run on the winning candidate.
    0.25 s by default: on 512-sequence real batches (planner_bench) a 0.5 s limit changed the
    simulated step time by under 0.01% and cost a quarter of a second of planning.
    ``checkpoint_levels``: the levels inside a decoder layer adaptive checkpointing may use beside
    whole layers (``()`` for whole layers only); ``checkpoint_sharing``: ``cell`` (a count per
    stage and unit) or ``diagonal`` (shared along backward diagonals, the paper's formulation);
    see docs/checkpoint_levels.md.  Baselines keep their static whole-layer setting.
    """
    t0 = time.perf_counter()
    if schedule not in SCHEDULES:
        from infinipipe_hf.planner.alternatives import ALTERNATIVES
        what = "is not a pipeline schedule" if schedule in ALTERNATIVES else "is not known"
        raise ValueError(f"schedule={schedule!r} {what}; use one of {', '.join(SCHEDULES)} (non-pipeline "
                         f"{', '.join(ALTERNATIVES)}: infinipipe_hf.planner.alternatives.plan_alternative)")
    if checkpointing not in ("adaptive", "none", "full"):
        raise ValueError(f"checkpointing={checkpointing!r} is not known; use adaptive, none or full")
    levels = check_levels(checkpoint_levels)
    if checkpoint_sharing not in ("cell", "diagonal"):
        raise ValueError(f"checkpoint_sharing={checkpoint_sharing!r} is not known; use cell or diagonal")
    solver = {"levels": levels, "sharing": checkpoint_sharing}
    check_batch(lengths)
    lengths = [int(n) for n in lengths]
    if cost is None:
        cost = CostModel(spec, profile, pp_degree=pp_degree, layers_per_stage=layers_per_stage,
                         memory_budget_bytes=memory_budget_bytes, loss_chunk_tokens=loss_chunk_tokens,
                         sp_degree=sp_degree, shard=shard, dp_degree=dp_degree, gpus_per_node=gpus_per_node)
    else:
        _check_cost_layout(cost, pp_degree, dp_degree, sp_degree, shard)
    replicas = assign_sequences(lengths, dp_degree, cost)
    policy = checkpointing
    if schedule != "epp" and checkpointing == "adaptive":
        policy = "uniform"  # baselines use one static checkpoint setting (Megatron/Seq1F1B style)

    builders = {
        "epp": lambda: epp_candidates(lengths, replicas, cost, num_slices, max_tokens_per_unit, policy,
                                       solver_time_limit_s),
        "packed-1f1b": lambda: baseline_candidates(lengths, replicas, cost, "packed-1f1b", policy,
                                                    max_tokens_per_unit),
        "seq1f1b": lambda: baseline_candidates(lengths, replicas, cost, "seq1f1b", policy, max_tokens_per_unit,
                                                num_slices),
        "gpipe": lambda: baseline_candidates(lengths, replicas, cost, "gpipe", policy, max_tokens_per_unit),
    }
    best: tuple[Plan, SimulationResult] | None = None
    tried: list[dict] = []
    last_error = None
    for knobs, make_plan in builders[schedule]():
        if schedule == "epp" and best is not None and len(tried) >= EXACT_CANDIDATES and not knobs.get("always_planned"):
            break  # ranked by the estimate: later candidates rarely win and each costs ~0.1-0.3 s
        try:
            plan = make_plan()
        except ValueError as exc:  # a knob value that cannot hold some sequence
            tried.append({**knobs, "feasible": False, "error": str(exc)})
            last_error = str(exc)
            continue
        biggest = max(u.num_tokens for u in plan.units) if max_tokens_per_unit is not None else 0
        if max_tokens_per_unit is not None and biggest > max_tokens_per_unit:
            # Baselines choose their packing/slicing lengths; a knob that makes units larger than
            # the user's cap is simply not a candidate.
            last_error = (f"{schedule} with {knobs} makes units of {biggest} tokens, over "
                          f"max_tokens_per_unit={max_tokens_per_unit}; raise max_tokens_per_unit "
                          f"or use schedule='epp' or 'seq1f1b', which cut long sequences")
            tried.append({**knobs, "feasible": False, "error": last_error})
            continue
        sim = simulate(plan, cost)
        tried.append({**knobs, "feasible": sim.feasible, "step_time_s": sim.step_time_s,
                      "recompute_time_s": sim.recompute_time_s,
                      **({"checkpoint_layers": plan.info["uniform_layers"]} if "uniform_layers" in plan.info else {})})
        if sim.feasible and (best is None or sim.step_time_s < best[1].step_time_s):
            best = (plan, sim)
    elapsed = time.perf_counter() - t0
    if best is None:
        error = _infeasible_message(lengths, cost, schedule, last_error)
        return PlanResult(schedule, None, None, False, error, elapsed, tried, cost.sp_degree, cost.shard)
    plan, sim = best
    if policy == "adaptive":
        # Candidates were compared with the greedy solver (milliseconds); only the winner pays for
        # the finer levels, per-cell counts and the LP/MILP.  Kept when its simulated step is
        # faster: per-cell counts save recompute but can add bubbles on the other stages.
        sol = solve_checkpointing(plan, cost, policy="adaptive", time_limit_s=solver_time_limit_s, **solver)
        if sol.feasible and sol.recompute_time_s < plan.info.get("recompute_time_s", float("inf")):
            before = (plan.checkpoint_layers, plan.checkpoint_levels, dict(plan.info))
            plan.checkpoint_layers = sol.checkpoint_layers
            plan.checkpoint_levels = sol.checkpoint_levels
            plan.info["checkpoint_method"] = sol.method
            plan.info["recompute_time_s"] = sol.recompute_time_s  # the info describes the kept plan
            solved = simulate(plan, cost)
            if solved.step_time_s <= sim.step_time_s:
                sim = solved
            else:
                plan.checkpoint_layers, plan.checkpoint_levels, plan.info = before
                plan.info["checkpoint_note"] = (f"final solve ({sol.method}) saved recompute but simulated "
                                                f"{solved.step_time_s:.4g} s > {sim.step_time_s:.4g} s; kept the greedy")
    validate(plan, cost, max_tokens_per_unit=max_tokens_per_unit)
    plan.info["candidates_tried"] = len(tried)
    return PlanResult(schedule, plan, sim, True, None, time.perf_counter() - t0, tried, cost.sp_degree, cost.shard)


def _check_cost_layout(cost: CostModel, pp_degree: int, dp_degree: int, sp_degree: int, shard: str) -> None:
    want = {"pp_degree": pp_degree, "dp_degree": dp_degree, "sp_degree": sp_degree, "shard": shard}
    got = {k: getattr(cost, k) for k in want}
    if got != want:
        diff = ", ".join(f"{k}={got[k]!r} (asked {want[k]!r})" for k in want if got[k] != want[k])
        raise ValueError(f"the cost model passed to plan_step was built for {diff}; build the "
                         f"CostModel with the same pp_degree, dp_degree, sp_degree and shard")


# --- errors ---------------------------------------------------------------------------------
def _infeasible_message(lengths, cost, schedule, last_error) -> str:
    longest = max(lengths)
    limit = largest_trainable_length(cost)
    budget = cost.memory_budget_bytes / 2**30
    if longest > limit:
        seq = lengths.index(longest)
        more = "sp_degree, " if cost.sp_degree < cost.spec.num_attention_heads else ""
        return (f"sequence {seq} of {longest} tokens cannot fit in {budget:.1f} GiB per GPU even fully "
                f"checkpointed and cut into {max(DEFAULT_SLICE_COUNTS)} slices; the largest that fits is "
                f"{limit} tokens: split or truncate longer documents, raise pp_degree, {more}or raise the memory budget")
    return (f"no {schedule} plan fits {budget:.1f} GiB per GPU for this batch "
            f"({len(lengths)} sequences, {sum(lengths)} tokens, longest {longest}); "
            f"last candidate said: {last_error}; use fewer tokens per step or schedule='epp'")
