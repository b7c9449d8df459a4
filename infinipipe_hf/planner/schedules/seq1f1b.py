"""``seq1f1b``: packed micro-batches cut into equal-token slices (Seq1F1B / SlimPipe), 1F1B.

Knobs: the packing length and the uniform slice count (the caller's ``num_slices``, a static
setting, or the grid of :func:`~.grids.slicing_candidates`).  Warm-up as EPP's with every
micro-batch's slice count: ``(pp - 1 - r) + (K - 1)`` forwards on stage ``r``.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.units import Unit
from infinipipe_hf.planner.batch.uniform import make_uniform_slices
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.schedules.baseline import BaselineSchedule, PackKnobs
from infinipipe_hf.planner.schedules.grids import MIN_SLICE_TOKENS, SLICE_COUNTS, slicing_candidates
from infinipipe_hf.planner.schedules.pipeline import epp_warmup
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext


class Seq1F1BSchedule(BaselineSchedule):
    name = "seq1f1b"

    def knobs(self, pack: int, k: int) -> PackKnobs:
        return PackKnobs(pack, k)

    def slice_counts(self, ctx: PipelineContext) -> list[int]:
        if ctx.num_slices:
            return sorted(set(int(k) for k in ctx.num_slices))
        return slicing_candidates(ctx.lengths, sp_degree=ctx.cost.sp_degree)

    def leanest_slices(self, cost: CostModel, n: int, max_slices: int) -> int:
        min_tokens = MIN_SLICE_TOKENS * cost.sp_degree
        return max(k for k in SLICE_COUNTS if k <= max_slices and (k == 1 or n // k >= min_tokens))

    def make_units(self, lengths: Sequence[int], cost: CostModel, pack: int, k: int, seqs: Sequence[int],
                   first_unit_id: int) -> list[Unit]:
        return make_uniform_slices(lengths, cost, pack, k, seqs=seqs, first_unit_id=first_unit_id)

    def warmup(self, pp_degree: int, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        return epp_warmup(pp_degree, num_slices)
