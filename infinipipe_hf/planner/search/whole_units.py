"""A candidate beside the schedule's own: every sequence one unit, its MLP in tiles.

Slicing a long sequence bounds what each unit holds but carries K/V: the KV store of earlier slices
and its pending gradients live from a slice's forward to the first slice's backward (on one GPU,
Llama-3.1-8B at 524K tokens: 128 GiB), and with the weights on the host every slice copies them up
and its gradients down.  A whole sequence as one unit carries nothing; its layers run their MLP in
tiles (``runtime/recompute/tiled_mlp.py``) so no MLP intermediate grows with it, and the checkpoint
solver recomputes or offloads its layers as the budgets allow (ALST's plan, in EPP's terms).
When that does not fit, the attention side goes in tiles too (``runtime/recompute/tiled_attention.py``,
plan key ``attention_tile_tokens``): a layer's backward then holds over the whole sequence only what
the attention kernel needs, and every layer is recomputed or offloaded (a kept layer is priced
as one whose attention side is whole, so none is kept).

Tried on one-stage layouts (a single unit per sequence leaves a pipeline nothing to overlap) without
sequence parallelism, with a host tier, when the batch has a sequence longer than one tile; the plan replaces the
search's pick only when nothing else fits or it simulates faster, so every other plan stays as it
was.  Trade-off: the tile is ALST's default (``hidden_size`` tokens per GPU), not searched.
"""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action, ActionKind
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.schedules.base import SearchState
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext
from infinipipe_hf.planner.simulate.simulator import simulate

KNOB = "whole_sequences_tiled_mlp"
"""The candidate's name in the search's record (``plan.info["candidate"]`` of its plan)."""
KNOB_ATTENTION = "whole_sequences_tiled_attention"
"""The same with the attention side in tiles too."""


def tile_tokens(cost) -> int:
    """Tokens per MLP tile per GPU: the hidden size, as ArcticTraining tiles."""
    return int(cost.spec.hidden_size)


def wanted(ctx: PipelineContext) -> bool:
    """Whether the batch and layout call for the candidate (module docstring)."""
    cost = ctx.cost
    if cost.dims.pp_degree != 1 or cost.dims.sp_degree != 1 or cost.host_budget_bytes <= 0 or ctx.sp_rounds:
        return False  # one stage; under SP the tiles are not yet checked against the runtime
    if ctx.policy not in ("adaptive", "greedy") or ctx.num_slices is not None:
        return False
    longest = max(ctx.lengths, default=0)
    cap = ctx.max_tokens_per_unit
    return longest > tile_tokens(cost) and (cap is None or longest <= cap)


def whole_sequence_plan(ctx: PipelineContext, schedule: str, attention: bool = False) -> Plan:
    """One unit per sequence on its replica (longest first, forward then backward), every unit
    longer than a tile per GPU with its MLP in tiles (``attention``: its attention side too);
    checkpointing not solved yet."""
    cost = ctx.cost
    units, actions = [], {}
    for dp_rank, seqs in enumerate(ctx.replicas):
        mine = [Unit(len(units) + i, (Segment(s, 0, ctx.lengths[s]),), 0, dp_rank) for i, s in enumerate(seqs)]
        units.extend(mine)
        actions[dp_rank] = [[Action(kind, u.id) for u in mine for kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]]
    tile = tile_tokens(cost)
    plan = Plan(schedule, 1, len(ctx.replicas), list(ctx.lengths), units, actions, {}, list(cost.layers_per_stage),
                {"candidate": KNOB_ATTENTION if attention else KNOB, "num_slices": 1}, cost.dims.sp_degree,
                cost.dims.shard)
    plan.mlp_tile_tokens = {u.id: tile for u in units if u.num_tokens > tile * cost.dims.sp_degree}
    if attention:
        plan.attention_tile_tokens = dict(plan.mlp_tile_tokens)
    return plan


def _recompute_kept_layers(plan: Plan) -> None:
    """Every layer of a unit with its attention side in tiles checkpointed or offloaded (module
    docstring): the layers the solver kept become whole-layer checkpoints."""
    layers = plan.layers_per_stage[0]
    per_unit = plan.checkpoint_layers.setdefault(0, {})
    for uid in plan.attention_tile_tokens:
        offloaded = plan.checkpoint_levels.get(0, {}).get(uid, {}).get("offload", 0)
        per_unit[uid] = layers - offloaded


def try_whole_sequences(ctx: PipelineContext, state: SearchState, schedule: str) -> None:
    """Plan the candidate and offer it to ``state`` when it fits (recorded in ``state.tried``
    either way)."""
    if not wanted(ctx):
        return
    for attention in (False, True):  # the attention side in tiles only when the MLP's are not enough
        plan = whole_sequence_plan(ctx, schedule, attention)
        sol = solve_checkpointing(plan, ctx.cost, policy="greedy", time_limit_s=ctx.time_limit_s, sharing="diagonal")
        if sol.feasible:
            break
        state.tried.append({"candidate": plan.info["candidate"], "feasible": False, "error": sol.message})
    else:
        return
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    _recompute_kept_layers(plan)
    plan.info.update(checkpoint_method=sol.method, recompute_time_s=sol.recompute_time_s)
    sim = simulate(plan, ctx.cost)
    state.tried.append({"candidate": plan.info["candidate"], "feasible": sim.feasible, "step_time_s": sim.step_time_s,
                        "recompute_time_s": sim.recompute_time_s})
    if sim.feasible:
        state.offer(plan, sim, "whole_sequences")
