"""What the replay charges each action of a plan: compute, input delay, and CPU on shared cores."""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel


class ActionCosts:
    """What the replay charges each action of ``plan``: its compute (``duration``: the cost
    model's forward or backward with the plan's checkpointing), the delay of its input
    (``transfer``), and on shared cores its work there (``shared_work``: the compute plus its share
    of the CPU its point-to-point messages cost, half of each message it sends or receives)."""

    def __init__(self, plan: Plan, cost: CostModel) -> None:
        self.plan, self.cost = plan, cost
        self.shapes = {u.id: UnitShape.of(u.segments) for u in plan.units}
        self.tokens = {u.id: u.num_tokens for u in plan.units}

    def _shape(self, uid: int) -> UnitShape:
        if uid not in self.shapes:
            raise ValueError(f"an action names unit {uid}, which is not among the plan's units; "
                             f"validate the plan (infinipipe_hf.planner.search.validator.validate)")
        return self.shapes[uid]

    def duration(self, stage: int, a: Action) -> float:
        shape = self._shape(a.unit)
        if a.is_forward:
            return self.cost.forward_time(stage, shape)
        t = self.cost.backward_time(stage, shape, self.plan.checkpointed(stage, a.unit))
        return t + self.finer_recompute(stage, a.unit)

    def finer_recompute(self, stage: int, uid: int) -> float:
        finer = self.plan.checkpoint_levels.get(stage, {}).get(uid)
        return self.cost.levels.finer_recompute_s(self.shapes[uid], CheckpointMix.of(0, finer)) if finer else 0.0

    def transfer(self, a: Action) -> float:
        self._shape(a.unit)
        return self.cost.transfer_time(self.tokens[a.unit])

    def message_cpu(self, stage: int, a: Action) -> float:
        """This action's half of the CPU of the messages it receives and sends (a forward receives
        from the previous stage and sends to the next, a backward the other way round)."""
        messages = (stage > 0) + (stage < self.plan.pp_degree - 1)
        return 0.5 * messages * self.cost.message_cpu_time(self.tokens[a.unit])

    def shared_work(self, stage: int, a: Action) -> float:
        return self.duration(stage, a) + self.message_cpu(stage, a)
