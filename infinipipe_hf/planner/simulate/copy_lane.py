"""The host copy stream of each stage: what every action copies between host and device memory
beside its compute, and the part of it that compute does not hide.

Per action, by source (the prices are the cost model's, :mod:`infinipipe_hf.planner.cost.host`,
:mod:`~infinipipe_hf.planner.cost.states`, :mod:`~infinipipe_hf.planner.cost.state_host`):
- ``offload``: the inputs of the unit's ``offload`` layers, out in the forward, back in the
  backward; the cost model charges both directions' exposed parts to the backward (its
  ``layer_exposed_s`` per layer, inside the level's recompute), so a forward shows 0 exposed;
- ``kv``: a stage in the plan's ``offload_kv`` copies context K/V in (and, in a backward, pending
  K/V gradients in and out) layer by layer; exposed: :meth:`ActionCosts.kv_exposed`;
- ``states``: ``states`` offload copies each unit's weight shard up in every action and, in a
  backward reducing per unit, its gradient shard down to be added on the host (CPU seconds);
  exposed: the action's time less the same action's without host copies (gathers and
  reductions alone), i.e. what the copies add to the chain the compute overlaps;
- the stage's ``step`` event after its last backward and gradient reduction: a per-step weight
  fetch (shard groups spanning replicas, inside the gradient sync) and the CPU optimizer step's
  tail (gradients down, AdamW on the CPU, weights up: ``state_host.step_tail_s``, all exposed).

So every event's ``exposed_s`` is exactly what the action's duration (or the stage's end)
already includes: the lanes show the copy stream and add no time.  Trade-off: an action's event
starts with the action and lasts its copy and CPU seconds (the cost model prices copies per
action, not a serialised stream), so a forward whose copies outlast it shows them running past
its end, and copies of different directions or actions are not shown contending.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import HOST_LEVELS, OFFLOAD
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.cost.states import ADD_OVER_ADAMW
from infinipipe_hf.planner.simulate.action_costs import ActionCosts
from infinipipe_hf.planner.simulate.result import CopyEvent


class CopyPart(NamedTuple):
    """One source's share of an event."""

    source: str
    bytes: float
    copy_s: float
    cpu_s: float
    exposed_s: float


def has_host_copies(plan: Plan, cost) -> bool:
    """Whether ``plan`` under ``cost`` copies anything between host and device (stand-in cost
    models without a host part never do)."""
    states = getattr(cost, "states", None)
    if states is not None and states.offload.offloaded:
        return True
    if getattr(cost, "host", None) is None:
        return False
    return plan.uses_host_tier


def copy_event(r: int, s: int, action: str, start: float, parts: list[CopyPart], *,
               step: bool = False, sub_group: tuple[int, int] | None = None) -> CopyEvent | None:
    """The event of ``parts`` (None when there are none); a ``step`` event lasts its exposed seconds;
    ``sub_group``: the SP ranks ``(offset, size)`` it runs on, None for the whole group."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    copy_s, cpu_s = sum(p.copy_s for p in parts), sum(p.cpu_s for p in parts)
    exposed = sum(p.exposed_s for p in parts)
    return CopyEvent(r, s, action, start, start + (exposed if step else copy_s + cpu_s),
                     sum(p.bytes for p in parts), copy_s, cpu_s, exposed, tuple(p.source for p in parts), sub_group)


class CopyLane:
    """The copy events of a plan's actions and stage ends under ``cost`` (module docstring)."""

    def __init__(self, plan: Plan, cost, costs: ActionCosts):
        self.plan, self.cost, self.costs = plan, cost, costs
        self.active = has_host_copies(plan, cost)
        self._bare: dict[int, object] = {}

    def action_event(self, r: int, s: int, a: Action, start: float) -> CopyEvent | None:
        """Replica ``r``'s stage ``s`` running ``a`` from ``start``: its copies, or None."""
        if not self.active:
            return None
        cost = self.costs.groups.get(a.unit, self.cost)
        group = self.plan.sp_groups.get(a.unit)
        return copy_event(r, s, str(a), start, [self._offload(cost, s, a), self._kv(cost, s, a),
                                                self._states(cost, s, a)],
                          sub_group=None if group is None else (group.offset, group.size))

    def step_event(self, r: int, s: int, sync_end: float, tail_s: float) -> CopyEvent | None:
        """The copies the stage's end adds after its last backward (``sync_end``: that backward's
        end plus the gradient sync, which holds a per-step fetch; ``tail_s``: the optimizer tail)."""
        states = getattr(self.cost, "states", None)
        if not self.active or states is None:
            return None
        host, p, shard = self.cost.host, states.precision, sum(states.shard_numel[s])
        parts = []
        fetch = sum(states.fetch_s[s]) if states.gathers_per_step and states.offload.weights_on_host else 0.0
        if fetch:
            parts.append(CopyPart("states", shard * p.weight_bytes_per_param, fetch, 0.0, fetch))
        if tail_s:
            on_device = not (states.offload.weights_on_host and states.reduces_per_unit)
            nbytes = (shard * p.reduce_bytes_per_param if on_device else 0.0) + (
                0.0 if states.offload.weights_on_host else shard * p.weight_bytes_per_param)
            cpu = shard / self.cost.profile.host_optimizer_params_per_s
            parts.append(CopyPart("step", nbytes, host.copy_s(nbytes), cpu, tail_s))
        return copy_event(r, s, "step", sync_end - fetch, parts, step=True)

    def _offload(self, cost, s: int, a: Action) -> CopyPart | None:
        counts = self.plan.checkpoint_levels.get(s, {}).get(a.unit) or {}
        held = [(lv, n) for lv in HOST_LEVELS if (n := counts.get(lv, 0))]
        if not held:
            return None
        shape = self.costs.shapes[a.unit]
        nbytes = sum(n * cost.host.layer_copy_bytes(shape, lv, backward=not a.is_forward) for lv, n in held)
        exposed = 0.0 if a.is_forward else sum(n * cost.host.layer_exposed_s(shape, lv) for lv, n in held)
        return CopyPart(OFFLOAD, nbytes, cost.host.copy_s(nbytes), 0.0, exposed)

    def _kv(self, cost, s: int, a: Action) -> CopyPart | None:
        if s not in self.plan.offload_kv:
            return None
        segments = self.plan.unit_by_id[a.unit].segments
        continuing = [self.plan.continues_after(x) for x in segments]
        nbytes = cost.host.kv_action_bytes(s, segments, continuing, not a.is_forward)
        if not nbytes:
            return None
        return CopyPart("kv", nbytes, cost.host.copy_s(nbytes), 0.0, self.costs.kv_exposed(s, a))

    def _states(self, cost, s: int, a: Action) -> CopyPart | None:
        states = cost.states
        if not states.offload.weights_on_host or states.gathers_per_step:
            return None
        p, shard = states.precision, sum(states.shard_numel[s])
        drains = not a.is_forward and states.reduces_per_unit
        nbytes = shard * (p.weight_bytes_per_param + (p.reduce_bytes_per_param if drains else 0.0))
        cpu = shard / (cost.profile.host_optimizer_params_per_s * ADD_OVER_ADAMW) if drains else 0.0
        return CopyPart("states", nbytes, cost.host.copy_s(nbytes), cpu, self._states_exposed(cost, s, a))

    def _states_exposed(self, cost, s: int, a: Action) -> float:
        """The action's time less the same action's with no host copies in its overlapped chain."""
        shape, bare = self.costs.shapes[a.unit], self._bare_compute(cost)
        if a.is_forward:
            return cost.compute.forward_time(s, shape) - bare.forward_time(s, shape)
        rec = cost.recompute_time(s, shape, self.plan.checkpointed(s, a.unit))
        return cost.compute.backward_time(s, shape, rec) - bare.backward_time(s, shape, rec)

    def _bare_compute(self, cost):
        """``cost.compute`` over states whose action chains hold the gathers and reductions only."""
        if id(cost) not in self._bare:
            compute = copy.copy(cost.compute)
            compute.states = cost.compute.states.without_host_copies()
            self._bare[id(cost)] = compute
        return self._bare[id(cost)]
