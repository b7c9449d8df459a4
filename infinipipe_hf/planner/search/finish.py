"""What ``plan_step`` does after the search: the final checkpoint solve and validation of the
winner, or the message saying why nothing fits.

Candidates are compared with the greedy checkpoint solve (milliseconds); the finer levels,
per-cell counts and the LP/MILP go to the winner and, per family of candidates (EPP's on whole SP
groups and with SP rounds), to the ``FINALISTS`` fastest the greedy put within ``RUNNER_UP_GAP`` of
the family's fastest.  The finer levels save more on some plans than on others (a round of large
units memory-bound at whole layers against more rounds of smaller units with room for them), so
the greedy's order can flip, and a search with SP rounds must end at least as fast as the search
on whole groups it contains.  A solved plan is kept when its simulated step is not slower
(per-cell counts save recompute but can add bubbles on the other stages).
"""
from __future__ import annotations

import dataclasses
import math
import time

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.checkpointing.host_peak import host_peak_bytes_per_stage
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.grids import DEFAULT_SLICE_COUNTS
from infinipipe_hf.planner.registry import REFERENCE
from infinipipe_hf.planner.schedules.base import SearchState
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext, PipelineSchedule
from infinipipe_hf.planner.search.limits import largest_trainable_length, states_advice, states_per_gpu
from infinipipe_hf.planner.search.result import PlanResult
from infinipipe_hf.planner.simulate.result import SimulationResult
from infinipipe_hf.planner.simulate.simulator import simulate
from infinipipe_hf.planner.validate.validator import validate


def finish_pipeline(schedule: PipelineSchedule, ctx: PipelineContext, state: SearchState, t0: float,
                    levels: tuple[str, ...], sharing: str) -> PlanResult:
    """The ``PlanResult`` of a pipeline search started at ``t0`` (``time.perf_counter``)."""
    cost = ctx.cost
    elapsed = time.perf_counter() - t0
    if state.best is None:
        error = infeasible_message(ctx.lengths, cost, schedule.name, state.last_error, ctx.policy)
        return PlanResult(schedule.name, None, None, False, error, elapsed, state.tried, cost.dims.sp_degree, cost.dims.shard)
    plan, sim = state.best
    if ctx.policy == "adaptive":
        finalists = [state.best] + [(p, s) for kept in state.finalists.values() for p, s in kept if p is not plan
                                    and s.step_time_s <= kept[0][1].step_time_s * (1 + RUNNER_UP_GAP)]
        solved = []
        for plan, sim in finalists:
            fastest = min((s.step_time_s for _, s in solved), default=math.inf)
            if sim.step_time_s - sim.recompute_time_s >= fastest:
                continue  # even with no recompute at all it would not be faster: not worth a solve
            sim = final_solve(plan, sim, cost, ctx.time_limit_s, levels, sharing)
            if sim.step_time_s - sim.recompute_time_s < fastest:  # the KV trial only saves recompute
                sim = kv_offload_trial(plan, sim, cost, ctx.time_limit_s, levels, sharing)
            solved.append((plan, sim))
        plan, sim = min(solved, key=lambda ps: ps[1].step_time_s)  # the winner on ties
    validate(plan, cost, max_tokens_per_unit=ctx.max_tokens_per_unit)
    plan.info["candidates_tried"] = len(state.tried)
    host = host_peak_bytes_per_stage(plan, cost)
    plan.info["host_peak_bytes_per_stage"] = host
    plan.info["host_peak_memory_bytes"] = max(host, default=0.0)
    return PlanResult(schedule.name, plan, sim, True, None, time.perf_counter() - t0, state.tried,
                      cost.dims.sp_degree, cost.dims.shard)


def finalists_bound_s(state: SearchState, cost: CostModel) -> float:
    """A lower bound of the step ``finish_pipeline`` returns from ``state``: the least over the plans
    it may finish of their units replayed with nothing checkpointed, offloaded or copied (the final
    solve and the KV trial change only that, and less of it never lengthens a replay)."""
    plans = [plan for kept in state.finalists.values() for plan, _ in kept]  # the best is first of its family
    return min(simulate(dataclasses.replace(plan, checkpoint_layers={}, checkpoint_levels={}, offload_kv=[]),
                        cost, memory=False).step_time_s for plan in plans)


RUNNER_UP_GAP = 0.05
"""The greedy's finalists are solved finely too when they simulated within this share of their
family's fastest."""


def final_solve(plan: Plan, sim: SimulationResult, cost: CostModel, time_limit_s: float,
                levels: tuple[str, ...], sharing: str) -> SimulationResult:
    """Re-solve ``plan``'s checkpointing adaptively (in place); returns the kept plan's simulation."""
    kv = list(plan.offload_kv)  # the solve may move KV stores to host memory
    sol = solve_checkpointing(plan, cost, policy="adaptive", time_limit_s=time_limit_s, levels=levels,
                              sharing=sharing)
    if not (sol.feasible and sol.recompute_time_s < plan.info.get("recompute_time_s", float("inf"))):
        plan.offload_kv = kv
        return sim
    before = (plan.checkpoint_layers, plan.checkpoint_levels, dict(plan.info), kv)
    plan.checkpoint_layers = sol.checkpoint_layers
    plan.checkpoint_levels = sol.checkpoint_levels
    plan.info["checkpoint_method"] = sol.method
    plan.info["recompute_time_s"] = sol.recompute_time_s  # the info describes the kept plan
    solved = simulate(plan, cost)
    if solved.step_time_s <= sim.step_time_s:
        return solved
    plan.checkpoint_layers, plan.checkpoint_levels, plan.info, plan.offload_kv = before
    plan.info["checkpoint_note"] = (f"final solve ({sol.method}) saved recompute but simulated "
                                    f"{solved.step_time_s:.4g} s > {sim.step_time_s:.4g} s; kept the greedy")
    return sim


def kv_offload_trial(plan: Plan, sim: SimulationResult, cost: CostModel, time_limit_s: float,
                     levels: tuple[str, ...], sharing: str) -> SimulationResult:
    """With a host tier, a plan that recomputes and keeps KV stores on the device tries them in host
    memory (every stage's ``offload_kv``): the device room it frees may save recompute.  Kept (in
    place) when it simulates faster; returns the kept plan's simulation."""
    if not (cost.host_budget_bytes > 0 and not plan.offload_kv and plan.info.get("recompute_time_s", 0.0) > 0
            and any(plan.continues_after(s) for u in plan.units for s in u.segments)):
        return sim
    before = (plan.checkpoint_layers, plan.checkpoint_levels, dict(plan.info))
    plan.offload_kv = list(range(plan.pp_degree))
    sol = solve_checkpointing(plan, cost, policy="adaptive", time_limit_s=time_limit_s, levels=levels,
                              sharing=sharing)
    if sol.feasible and sol.recompute_time_s < plan.info["recompute_time_s"]:
        plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
        plan.info.update(checkpoint_method=sol.method, recompute_time_s=sol.recompute_time_s)
        solved = simulate(plan, cost)
        if solved.step_time_s < sim.step_time_s:
            return solved
    plan.checkpoint_layers, plan.checkpoint_levels, plan.info = before
    plan.offload_kv = []
    return sim


def host_states_message(cost: CostModel, schedule: str) -> str | None:
    """Why no plan can fit when the model states a stage keeps on the host exceed the host budget
    alone (0 without a host tier), else None."""
    host = [cost.host.state_host_bytes(s) for s in range(cost.dims.pp_degree)]
    s = max(range(len(host)), key=host.__getitem__)
    if host[s] <= cost.host_budget_bytes:
        return None
    budget = cost.host_budget_bytes
    return (f"no {schedule} plan fits: state_offload={cost.dims.state_offload.name!r} keeps {host[s] / 2**30:.3g} GiB "
            f"of stage {s}'s model states in host memory per GPU but the host budget is {budget / 2**30:.3g} GiB"
            + (" (no host tier)" if not budget else "") + "; give a host budget of at least that (--host-memory-gib, "
            "host_memory_gib), shard the states over more GPUs or use more pipeline stages")


def infeasible_message(lengths: list[int], cost: CostModel, schedule: str, last_error: str | None,
                       policy: str = "adaptive") -> str:
    """Why no candidate of ``schedule`` fits, by cause, with the numbers and what would change it:
    the model states (nothing fits at any length), one sequence over the largest trainable length,
    or the batch's activations (``policy``: the checkpointing the candidates were compared with)."""
    longest, budget = max(lengths), cost.memory_budget_bytes / 2**30
    states = states_per_gpu(cost)
    limit = largest_trainable_length(cost, schedule=schedule) if states < cost.memory_budget_bytes else 0
    if limit == 0:
        return f"no {schedule} plan fits: {states_advice(cost)}"
    room = (f"model states take {states / 2**30:.3g} GiB of the {budget:.3g} GiB budget per GPU, leaving "
            f"{budget - states / 2**30:.3g} GiB for activations")
    more = "sp_degree, " if cost.dims.sp_degree < cost.spec.num_attention_heads else ""
    reference = REFERENCE
    other = "" if schedule == reference else f", or schedule={reference!r}"
    if not cost.host_budget_bytes and schedule == reference:  # only the reference's solver offloads
        other += ", or a host memory budget to offload to (--host-memory-gib, host_memory_gib)"
    if longest > limit:
        how = (f"and cut into {max(DEFAULT_SLICE_COUNTS)} slices" if schedule == reference
               else f"in {schedule}'s leanest plan of it")
        return (f"sequence {lengths.index(longest)} of {longest} tokens cannot fit in {budget:.3g} GiB per GPU even "
                f"fully checkpointed {how} ({room}); the largest that fits is {limit} tokens: split or truncate "
                f"longer documents (the trainer cuts documents longer than tokens_per_step into pieces), raise "
                f"pp_degree, {more}or raise the memory budget{other}")
    recompute = {"adaptive": "checkpointing is already adaptive (layers are recomputed as memory needs)",
                 "full": "every layer is already checkpointed",
                 "uniform": f"{schedule} checkpoints one static count of layers for every unit"}.get(
        policy, f"checkpointing={policy!r}; 'adaptive' recomputes layers as memory needs")
    return (f"no {schedule} plan fits {budget:.3g} GiB per GPU for this batch ({len(lengths)} sequences, "
            f"{sum(lengths)} tokens, longest {longest}); one sequence fits alone with every layer checkpointed "
            f"(up to {limit} tokens), so the batch's activations are what does not fit ({room}); {recompute}; "
            f"use fewer tokens per step "
            f"(tokens_per_step), more stages (pp_degree), {more}or a larger budget{other}; "
            f"last candidate said: {last_error}")
