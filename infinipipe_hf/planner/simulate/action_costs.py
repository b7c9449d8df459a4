"""What the replay charges each action of a plan: compute, input delay, and the CPU its messages cost."""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel, unit_cost_map


class ActionCosts:
    """What the replay charges each action of ``plan``: its compute (``duration``: the cost
    model's forward or backward with the plan's checkpointing), the delay of its input
    (``transfer``), and its work on a core that also runs the transport (``shared_work``: the
    compute plus its share of the CPU its point-to-point messages cost, half of each message it
    sends or receives; what a replica replay on shared hardware charges, see :mod:`.simulator`).

    With SP rounds (``steps``, :mod:`.sp_round_steps`) a replayed action is a whole round on the
    stage: its slowest unit's compute and its largest transfer, each unit priced on its own
    sub-group (``unit_duration``, ``unit_transfer``).

    A unit on an SP group of several ranks also pays the calibration's ``group_round_s``, the fixed
    cost of running one group once through the model that FlexSP's rounds pay per group: spread
    over its forward and backward on every stage, so a unit pays it once per step, as a FlexSP
    group does per round."""

    def __init__(self, plan: Plan, cost: CostModel, steps=None) -> None:
        self.plan, self.cost = plan, cost
        profile = getattr(cost, "profile", None)  # stand-in cost models in tests carry none
        context_pairs = profile.context_pairs if profile else "band"
        self.shapes = {u.id: UnitShape.of(u.segments, context_pairs) for u in plan.units}
        self.tokens = {u.id: u.num_tokens for u in plan.units}
        self.groups = unit_cost_map(plan, cost) if plan.sp_groups else {}
        self.steps = steps
        self.group_fixed_s = profile.calibration.group_round_s / (2 * plan.pp_degree) if profile else 0.0
        self._kv_exposed: dict[tuple[int, int, bool], float] = {}
        self._durations: dict[tuple[int, int, bool], float] = {}

    def _shape(self, uid: int) -> UnitShape:
        if uid not in self.shapes:
            raise ValueError(f"an action names unit {uid}, which is not among the plan's units; "
                             f"validate the plan (infinipipe_hf.planner.validate.validator.validate)")
        return self.shapes[uid]

    def duration(self, stage: int, a: Action) -> float:
        if self.steps is not None:
            return self.steps.step_duration(self.unit_duration, stage, a)
        return self.unit_duration(stage, a)

    def unit_duration(self, stage: int, a: Action) -> float:
        """The unit's compute on the stage (asked again for a round's events after the replay:
        computed once per action)."""
        key = (stage, a.unit, a.is_forward)  # plain values: an Action hashes through its enum
        got = self._durations.get(key)
        if got is None:
            got = self._durations[key] = self._unit_duration(stage, a)
        return got

    def _unit_duration(self, stage: int, a: Action) -> float:
        shape = self._shape(a.unit)
        cost = self.groups.get(a.unit, self.cost)
        fixed = self.group_fixed_s if self.group_fixed_s and self.plan.sub_group(a.unit).size > 1 else 0.0
        if stage in self.plan.offload_kv:  # the host KV store's copies that outlast the compute
            fixed += self.kv_exposed(stage, a)
        fixed += self.kv_exchange(stage, a)
        if a.is_forward:
            return cost.compute.forward_time(stage, shape) + fixed
        t = cost.backward_time(stage, shape, self.plan.checkpointed(stage, a.unit))
        return t + self.finer_recompute(stage, a.unit) + fixed

    def kv_exposed(self, stage: int, a: Action) -> float:
        """Exposed copy seconds of the action on a stage whose KV store is in host memory (once per
        action: the replay and the copy lane both ask)."""
        key = (stage, a.unit, a.is_forward)
        got = self._kv_exposed.get(key)
        if got is None:
            segments = self.plan.unit_by_id[a.unit].segments
            got = self._kv_exposed[key] = self.groups.get(a.unit, self.cost).host.kv_exposed_s(
                stage, segments, [self.plan.continues_after(s) for s in segments], not a.is_forward)
        return got

    def kv_exchange(self, stage: int, a: Action) -> float:
        """Seconds the action's context reads spend exchanging a shared K/V head's store chunks
        (:meth:`~infinipipe_hf.planner.cost.ulysses.UlyssesCost.kv_exchange_s`): every layer's read
        in the forward; in the backward the gradients' chunks back for every layer and the reads
        again for the layers that replay their forward."""
        ulysses = self.groups.get(a.unit, self.cost).ulysses if self.groups else getattr(self.cost, "ulysses", None)
        if ulysses is None or ulysses.kv_store_share == 1:
            return 0.0
        per_layer = sum(ulysses.kv_exchange_s(s.start) for s in self.plan.unit_by_id[a.unit].segments if s.start)
        if not per_layer:
            return 0.0
        layers = self.cost.layers_per_stage[stage]
        return per_layer * (layers if a.is_forward else layers + self.plan.checkpoint_mix(stage, a.unit).replayed_whole)

    def recompute(self, stage: int, uid: int) -> float:
        """Seconds the unit's backward on the stage spends recomputing (whole layers and finer levels)."""
        cost = self.groups.get(uid, self.cost)
        return (cost.recompute_time(stage, self.shapes[uid], self.plan.checkpointed(stage, uid))
                + self.finer_recompute(stage, uid))

    def finer_recompute(self, stage: int, uid: int) -> float:
        finer = self.plan.checkpoint_levels.get(stage, {}).get(uid)
        cost = self.groups.get(uid, self.cost)
        t = cost.levels.finer_recompute_s(self.shapes[uid], CheckpointMix.of(0, finer)) if finer else 0.0
        if uid in self.plan.mlp_tile_tokens:  # the tiles rerun their gate and up projections
            mix = CheckpointMix.of(self.plan.checkpointed(stage, uid), finer)
            t += cost.levels.tiled_mlp_recompute_s(stage, self.shapes[uid], mix)
        if uid in self.plan.attention_tile_tokens:  # the tiles rerun q/k/v and o_proj
            t += cost.levels.tiled_attention_recompute_s(stage, self.shapes[uid])
        return t

    def transfer(self, a: Action) -> float:
        if self.steps is not None:
            return self.steps.step_transfer(self.unit_transfer, a)
        return self.unit_transfer(a)

    def unit_transfer(self, a: Action) -> float:
        self._shape(a.unit)
        return self.groups.get(a.unit, self.cost).compute.transfer_time(self.tokens[a.unit])

    def message_cpu(self, stage: int, a: Action) -> float:
        """This action's half of the CPU of the messages it receives and sends (a forward receives
        from the previous stage and sends to the next, a backward the other way round; a round:
        its largest unit's, every rank sending its own)."""
        messages = (stage > 0) + (stage < self.plan.pp_degree - 1)
        if self.steps is None:
            return 0.5 * messages * self.cost.compute.message_cpu_time(self.tokens[a.unit])
        return max(0.5 * messages * self.groups.get(u, self.cost).compute.message_cpu_time(self.tokens[u])
                   for u in self.steps.units(a.unit))

    def shared_work(self, stage: int, a: Action) -> float:
        """Work at full speed of the action plus its half of its messages' CPU (``message_cpu``)."""
        return self.duration(stage, a) + self.message_cpu(stage, a)
