"""``packed-1f1b``: whole sequences packed into micro-batches (Megatron/DeepSpeed/torchtitan), 1F1B."""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.actions import one_f_one_b_warmup
from infinipipe_hf.planner.schedules.baseline import BaselineSchedule


class Packed1F1BSchedule(BaselineSchedule):
    name = "packed-1f1b"

    def warmup(self, dims: ParallelDims, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        return one_f_one_b_warmup(dims)
