"""The validator's checks of the host tier: the plan's ``offload_kv`` stages, and each stage's host
memory (model states kept on the host, offloaded layer inputs, an offloaded KV store) within the
cost model's host budget (:mod:`infinipipe_hf.planner.checkpointing.host_peak`).

Each check returns ``None`` or ``(problem, dp_rank, marks)`` like :mod:`.sp_round_checks`.
"""
from __future__ import annotations

from infinipipe_hf.ir.levels import OFFLOAD, OFFLOAD_ATTN, OFFLOAD_PAIR
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.checkpointing.host_peak import offloaded_bytes, stage_host_peak_bytes
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.validate.sp_round_checks import Problem

HOST_SLACK_BYTES = 1.0
"""Bytes of float noise allowed over the host budget."""
FIX = "raise the host budget (--host-memory-gib, host_memory_gib)"


def offload_kv_stages(plan: Plan) -> Problem:
    """``offload_kv`` names existing stages, each once."""
    bad = [s for s in plan.offload_kv if not 0 <= s < plan.pp_degree]
    if bad or len(set(plan.offload_kv)) != len(plan.offload_kv):
        return (f"offload_kv={list(plan.offload_kv)} must name distinct stages in 0..{plan.pp_degree - 1} (stages "
                f"whose KV store lives in host memory)", None, [])
    return None


def host_memory(plan: Plan, cost: CostModel, dp_rank: int) -> Problem:
    """Every stage's host peak on the replica within ``cost.host_budget_bytes``."""
    if getattr(cost, "host", None) is None:  # stand-in cost models of tests
        return None
    budget = cost.host_budget_bytes
    if not (budget or plan.uses_host_tier or any(map(cost.host.state_host_bytes, range(plan.pp_degree)))):
        return None  # no host tier and nothing on it
    for s in range(plan.pp_degree):
        peak = stage_host_peak_bytes(plan, cost, dp_rank, s)
        if peak <= budget + HOST_SLACK_BYTES:
            continue
        levels = plan.checkpoint_levels.get(s, {})
        by_id = plan.unit_by_id
        held = {u: offloaded_bytes(cost, s, by_id[u].segments, per) for u, per in levels.items() if u in by_id}
        unit = max(held, key=held.get) if held and max(held.values()) > 0 else None
        parts = [f"states {cost.host.state_host_bytes(s) / GIB:.2f} GiB"]
        if s in plan.offload_kv:
            parts.append("its KV store")
        if unit is not None:
            parts.append(f"unit {unit} offloads {levels[unit].get(OFFLOAD, 0)} layer inputs, "
                         f"{levels[unit].get(OFFLOAD_ATTN, 0)} layers' kept attention and "
                         f"{levels[unit].get(OFFLOAD_PAIR, 0)} paired layers "
                         f"({held[unit] / GIB:.2f} GiB, {held[unit]:.0f} bytes)")
        if not budget:
            fix = "give the plan a host budget (--host-memory-gib, host_memory_gib) or plan without offload"
        else:
            fix = f"{FIX}, offload fewer layers (recompute them) or use more pipeline stages"
        marks = [(s, i) for i, a in enumerate(plan.stage_actions(dp_rank, s))
                 if unit is not None and a.unit == unit and a.is_forward]
        return (f"stage {s} of dp replica {dp_rank} needs {peak / GIB:.2f} GiB ({peak:.0f} bytes) of host memory "
                f"({'; '.join(parts)}), over the host budget of {budget / GIB:.2f} GiB ({budget:.0f} bytes) per GPU; "
                f"{fix}", dp_rank, marks[:1])
    return None
