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

import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from .baselines import make_packed_units, make_uniform_slices, packing_candidates, slicing_candidates
from .checkpoint_levels import FINER_LEVELS, check_levels
from .checkpoint_solver import solve_checkpointing
from .cost_model import CostModel
from .dp_assign import assign_sequences
from .estimate import PipelineEstimator
from .grouping import group_pipelines
from .hardware import HardwareProfile
from .limits import largest_trainable_length
from .model_spec import ModelSpec
from .plan import Plan
from .schedule import (backward_order, build_pipeline_actions, concat_pipelines, epp_warmup,
                       gpipe_warmup, one_f_one_b_warmup)
from .sequence_processor import make_elastic_units
from .simulator import SimulationResult, simulate
from .units import Unit
from .validator import validate

SCHEDULES = ("epp", "packed-1f1b", "seq1f1b", "gpipe")
DEFAULT_SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MIN_SLICE_TOKENS = 256
"""Fewest tokens per GPU in a slice of the longest sequence searched (thinner slices run the GPU badly)."""
EXACT_CANDIDATES = 3  # EPP knob settings planned and simulated exactly, best estimates first
MAX_GROUPING_BLOCKS = 24
MAX_EXACT_CANDIDATES = 8  # when the best estimates do not fit, a few more are tried


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
        from .alternatives import ALTERNATIVES
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
        "epp": lambda: _epp_candidates(lengths, replicas, cost, num_slices, max_tokens_per_unit, policy,
                                       solver_time_limit_s),
        "packed-1f1b": lambda: _baseline_candidates(lengths, replicas, cost, "packed-1f1b", policy,
                                                    max_tokens_per_unit),
        "seq1f1b": lambda: _baseline_candidates(lengths, replicas, cost, "seq1f1b", policy, max_tokens_per_unit,
                                                num_slices),
        "gpipe": lambda: _baseline_candidates(lengths, replicas, cost, "gpipe", policy, max_tokens_per_unit),
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


# --- EPP -----------------------------------------------------------------------------------
def _slice_count_candidates(lengths: Sequence[int], num_slices: Sequence[int] | None,
                            sp_degree: int = 1) -> list[int]:
    if num_slices:
        return sorted(set(int(k) for k in num_slices))
    longest = max(lengths)
    ks = [k for k in DEFAULT_SLICE_COUNTS if k == 1 or longest / k >= MIN_SLICE_TOKENS * sp_degree]
    return ks


def _token_floor_candidates(lengths: Sequence[int], sp_degree: int = 1) -> list[int | None]:
    """Unit token floors tried next to the slice mesh: packing short sequences into units larger than
    the longest sequence's slice pays off when every sequence is short (few, efficient units).
    A stage of ``sp_degree`` GPUs runs a unit ``sp_degree`` times longer as efficiently."""
    longest = max(lengths)
    return [None] + [p * sp_degree for p in (4096, 8192, 16384) if longest < p * sp_degree < sum(lengths)]


def _epp_candidates(lengths, replicas, cost, num_slices, max_tokens_per_unit, policy, time_limit):
    """EPP knobs ranked by the closed-form estimate; the best few are planned and simulated exactly."""
    ranked = []
    floors = _token_floor_candidates(lengths, cost.sp_degree) if max_tokens_per_unit is None else [None]
    for k in _slice_count_candidates(lengths, num_slices, cost.sp_degree):
        for floor in (floors if k == 1 else [None]):
            try:
                staged = _epp_units(lengths, replicas, cost, k, max_tokens_per_unit, floor)
            except ValueError:
                continue
            ranked.append((max(est for _, _, est in staged), k, floor, staged))
    # Among candidates the estimate calls infeasible, more slices (less memory) go first.
    ranked.sort(key=lambda r: (r[0], -r[1] if math.isinf(r[0]) else r[1]))
    # The unsliced candidate (whole sequences, as the packing baselines run) is always planned: the
    # estimate misranks it by several percent (Llama-30B, 96K, sp 8: 3% over K=3, exact 3% under).
    at = next((i for i, r in enumerate(ranked) if r[1] == 1 and r[2] is None), -1)
    moved = at >= EXACT_CANDIDATES and not math.isinf(ranked[at][0])
    if moved:
        ranked.insert(EXACT_CANDIDATES, ranked.pop(at))
    for i, (est, k, floor, staged) in enumerate(ranked[:MAX_EXACT_CANDIDATES]):
        knobs = {"num_slices": k, "estimate_s": est, **({"always_planned": True} if moved and i == EXACT_CANDIDATES else {})}
        if floor:
            knobs["unit_token_floor"] = floor
        yield knobs, (lambda k=k, floor=floor, staged=staged:
                      _epp_plan(lengths, replicas, cost, k, floor, staged, policy, time_limit))


def _epp_units(lengths, replicas, cost, k, max_tokens_per_unit, floor):
    """Per replica: (slicing result, pipelines of units, estimated time)."""
    staged = []
    next_id = 0
    for seqs in replicas:
        if not seqs:
            staged.append((None, [], 0.0))
            continue
        res = make_elastic_units(lengths, cost, k, seqs=seqs, max_tokens_per_unit=max_tokens_per_unit,
                                 first_unit_id=next_id, min_token_budget=floor)
        next_id += len(res.units)
        per_id = {u.id: u for u in res.units}
        blocks = _blocks_by_slice_count(res.units, res.slice_counts)
        if len(blocks) > MAX_GROUPING_BLOCKS:
            blocks = _merge_blocks(blocks, MAX_GROUPING_BLOCKS)
        estimator = PipelineEstimator(res.units, cost, lengths)
        groups = group_pipelines(blocks, estimator.time_of_ids)
        pipelines = [[per_id[i] for i in ids] for ids in groups]
        est = sum(estimator.time_of_ids(ids) for ids in groups)
        staged.append((res, pipelines, est))
    return staged


def _merge_blocks(blocks: list[list[int]], limit: int) -> list[list[int]]:
    """Merge neighbouring blocks (smallest first) until at most ``limit`` remain."""
    blocks = [list(b) for b in blocks]
    while len(blocks) > limit:
        i = min(range(len(blocks) - 1), key=lambda j: len(blocks[j]) + len(blocks[j + 1]))
        blocks[i:i + 2] = [blocks[i] + blocks[i + 1]]
    return blocks


def _epp_plan(lengths, replicas, cost, k, floor, staged, policy, time_limit) -> Plan:
    units: list[Unit] = []
    actions = {}
    info = {"num_slices": k, "token_budget": [], "balance": []}
    if floor:
        info["unit_token_floor"] = floor
    for dp_rank, (res, pipelines, _) in enumerate(staged):
        if res is None:
            actions[dp_rank] = [[] for _ in range(cost.pp_degree)]
            continue
        info["token_budget"].append(res.token_budget)
        info["balance"].append(round(res.balance(), 4))
        part_units, actions[dp_rank] = _replica_actions(lengths, cost, pipelines, dp_rank, "epp")
        units.extend(part_units)
    plan = Plan("epp", cost.pp_degree, len(replicas), list(lengths), units, actions, {},
                list(cost.layers_per_stage), info, cost.sp_degree, cost.shard)
    # Candidates are compared with the greedy on whole layers and diagonal-shared counts: the
    # cheapest solve (a few ms), and a fair ranking since every candidate gets the same.  The
    # winner alone gets the finer levels, its own counts per cell and the LP/MILP (plan_step).
    sol = solve_checkpointing(plan, cost, policy="greedy" if policy == "adaptive" else policy,
                              time_limit_s=time_limit, sharing="diagonal")
    if not sol.feasible:
        raise ValueError(sol.message or "no checkpointing fits the memory budget")
    plan.checkpoint_layers = sol.checkpoint_layers
    plan.checkpoint_levels = sol.checkpoint_levels
    plan.info["checkpoint_method"] = sol.method
    plan.info["recompute_time_s"] = sol.recompute_time_s
    return plan


def _blocks_by_slice_count(units: Sequence[Unit], slice_counts: dict[int, int]) -> list[list[int]]:
    """Grouping blocks: one per slice chain of a long sequence, one per run of packed units.

    A chain never straddles two pipelines; separate blocks per chain let the grouping DP put a
    pipeline boundary between two long sequences (their K/V stores then never coexist).
    """
    blocks: list[list[int]] = []
    last_is_chain = False
    for u in units:
        count = max(slice_counts.get(s.seq, 1) for s in u.segments)
        continues_chain = any(s.start > 0 for s in u.segments)
        starts_chain = count > 1 and not continues_chain
        if not blocks or starts_chain or (count == 1 and last_is_chain):
            blocks.append([u.id])
            last_is_chain = starts_chain
        else:
            blocks[-1].append(u.id)
    return blocks


def _replica_actions(lengths, cost, pipelines: Sequence[Sequence[Unit]], dp_rank: int, schedule: str,
                     uniform_slices: int = 1) -> tuple[list[Unit], list[list]]:
    """Units (tagged with pipeline and replica) and per-stage actions of one DP replica."""
    pp = cost.pp_degree
    units: list[Unit] = []
    per_pipeline = []
    for p_index, punits in enumerate(pipelines):
        tagged = [replace(u, pipeline=p_index, dp_rank=dp_rank) for u in punits]
        units.extend(tagged)
        if schedule == "gpipe":
            warm = gpipe_warmup(pp, len(tagged))
        elif schedule == "epp":
            first_seq = tagged[0].segments[0].seq
            warm = epp_warmup(pp, sum(1 for u in tagged if first_seq in u.seqs))
        elif schedule == "seq1f1b":
            warm = epp_warmup(pp, uniform_slices)
        else:
            warm = one_f_one_b_warmup(pp)
        per_pipeline.append(build_pipeline_actions([u.id for u in tagged], backward_order(tagged, lengths), pp, warm))
    return units, concat_pipelines(per_pipeline)


# --- baselines ------------------------------------------------------------------------------
def _baseline_candidates(lengths, replicas, cost, schedule, policy, max_tokens_per_unit=None, num_slices=None):
    packs = packing_candidates(lengths, cost.sp_degree)
    if max_tokens_per_unit is not None:
        # The cap itself (or the longest sequence, which packing never cuts) as the tightest pack.
        packs = sorted(set(packs) | {max(max(lengths), int(max_tokens_per_unit))})
    slice_counts = [1]
    if schedule == "seq1f1b":  # uniform slice counts: the caller's (a static setting) or the grid
        slice_counts = (sorted(set(int(k) for k in num_slices)) if num_slices
                        else slicing_candidates(lengths, sp_degree=cost.sp_degree))
    for pack in packs:
        for k in slice_counts:
            knobs = {"pack_tokens": pack} if schedule != "seq1f1b" else {"pack_tokens": pack, "num_slices": k}
            yield knobs, (lambda pack=pack, k=k: _baseline_plan(lengths, replicas, cost, schedule, pack, k, policy))


def _baseline_plan(lengths, replicas, cost, schedule, pack, k, policy) -> Plan:
    units: list[Unit] = []
    actions = {}
    for dp_rank, seqs in enumerate(replicas):
        if not seqs:
            actions[dp_rank] = [[] for _ in range(cost.pp_degree)]
            continue
        if schedule == "seq1f1b":
            made = make_uniform_slices(lengths, cost, pack, k, seqs=seqs, first_unit_id=len(units))
        else:
            made = make_packed_units(lengths, cost, pack, seqs=seqs, first_unit_id=len(units))
        part_units, actions[dp_rank] = _replica_actions(lengths, cost, [made], dp_rank, schedule, k)
        units.extend(part_units)
    info = {"pack_tokens": pack}
    if schedule == "seq1f1b":
        info["num_slices"] = k
    plan = Plan(schedule, cost.pp_degree, len(replicas), list(lengths), units, actions, {},
                list(cost.layers_per_stage), info, cost.sp_degree, cost.shard)
    sol = solve_checkpointing(plan, cost, policy=policy)
    if not sol.feasible:
        raise ValueError(sol.message or "no checkpointing fits the memory budget")
    plan.checkpoint_layers = sol.checkpoint_layers
    plan.info["checkpoint_method"] = sol.method
    if policy == "uniform":  # the one count (static settings over a run take the largest of a run)
        plan.info["uniform_layers"] = max((c for per in sol.checkpoint_layers.values() for c in per.values()), default=0)
    return plan


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
