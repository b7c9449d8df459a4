"""The pipeline baselines: micro-batches of whole sequences (packed, or sliced) in 1F1B pipelines.

``packed-1f1b``, ``seq1f1b`` and ``gpipe`` share this class.  Their knobs are a packing length
(``max(longest, 2^k)``, :func:`~.grids.packing_candidates`) and, for seq1f1b, a slice count and
how slices are balanced (:class:`PackKnobs`); every setting of the small grid is planned with the
least uniform checkpoint count that fits, so the speed ratios compare tuned baselines.  A subclass
names itself, gives its warm-up and, when it cuts micro-batches, its slicings and units.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.planner.batch.uniform import SliceBalance, make_packed_units
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.actions import replica_actions
from infinipipe_hf.planner.pipeline.grids import packing_candidates
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext, PipelineSchedule


@dataclass(frozen=True)
class PackKnobs(Knobs):
    pack_tokens: int
    num_slices: int | None = None
    """Slices per micro-batch (seq1f1b only)."""
    slice_balance: SliceBalance | None = None
    """What a micro-batch's slices have equal amounts of: ``tokens`` or layer ``compute`` (seq1f1b only,
    :func:`~infinipipe_hf.planner.batch.uniform.make_uniform_slices`)."""

    def record(self) -> dict:
        d = {"pack_tokens": self.pack_tokens}
        if self.num_slices is not None:
            d["num_slices"] = self.num_slices
        if self.slice_balance is not None:
            d["slice_balance"] = self.slice_balance
        return d

    @staticmethod
    def from_record(d: dict) -> "PackKnobs":
        """The knobs of a candidate record (:meth:`record`, plus any other keys)."""
        k = d.get("num_slices")
        return PackKnobs(int(d["pack_tokens"]), None if k is None else int(k), d.get("slice_balance"))


class BaselineSchedule(PipelineSchedule):
    """A baseline over packing lengths (module docstring); micro-batches run whole by default."""

    static_packing = True

    def slicings(self, ctx: PipelineContext) -> list[tuple[int | None, SliceBalance | None]]:
        """``(num_slices, slice_balance)`` pairs searched per packing length (whole micro-batches here)."""
        return [(None, None)]

    def make_units(self, lengths: Sequence[int], cost: CostModel, knobs: PackKnobs, seqs: Sequence[int],
                   first_unit_id: int) -> list[Unit]:
        """The units of one replica's sequences ``seqs``, in forward order."""
        return make_packed_units(lengths, cost, knobs.pack_tokens, seqs=seqs, first_unit_id=first_unit_id)

    def candidates(self, ctx: PipelineContext, state: SearchState) -> Iterator[Candidate]:
        packs = packing_candidates(ctx.lengths, ctx.cost.dims.sp_degree)
        if ctx.max_tokens_per_unit is not None:
            # The cap itself (or the longest sequence, which packing never cuts) as the tightest pack.
            packs = sorted(set(packs) | {max(max(ctx.lengths), int(ctx.max_tokens_per_unit))})
        slicings = self.slicings(ctx)
        for pack in packs:
            for k, balance in slicings:
                knobs = PackKnobs(pack, k, balance)
                yield Candidate(knobs, partial(self.plan, ctx.lengths, ctx.replicas, ctx.cost, knobs, ctx.policy))

    def leanest_plan(self, cost: CostModel, n: int, max_slices: int) -> Plan:
        return self.plan([n], [[0]], cost, PackKnobs(n), "full")

    def plan(self, lengths, replicas, cost, knobs: PackKnobs, policy) -> Plan:
        """One pipeline per replica of its micro-batches under ``knobs``, checkpointed under ``policy``."""
        units: list[Unit] = []
        actions = {}
        for dp_rank, seqs in enumerate(replicas):
            if not seqs:
                actions[dp_rank] = [[] for _ in range(cost.dims.pp_degree)]
                continue
            made = self.make_units(lengths, cost, knobs, seqs, len(units))
            part_units, actions[dp_rank] = replica_actions(lengths, cost, [made], dp_rank,
                                                           partial(self.warmup, cost.dims,
                                                                   num_slices=knobs.num_slices or 1))
            units.extend(part_units)
        info = knobs.record()
        plan = Plan(self.name, cost.dims.pp_degree, len(replicas), list(lengths), units, actions, {},
                    list(cost.layers_per_stage), info, cost.dims.sp_degree, cost.dims.shard)
        sol = solve_checkpointing(plan, cost, policy=policy)
        if not sol.feasible:
            raise ValueError(sol.message or "no checkpointing fits the memory budget")
        plan.checkpoint_layers = sol.checkpoint_layers
        plan.info["checkpoint_method"] = sol.method
        if policy == "uniform":  # the one count (static settings over a run take the largest of a run)
            plan.info["uniform_layers"] = max((c for per in sol.checkpoint_layers.values() for c in per.values()),
                                              default=0)
        return plan
