"""``gpipe``: packed micro-batches, every forward before any backward (GPipe)."""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.actions import gpipe_warmup
from infinipipe_hf.planner.schedules.baseline import BaselineSchedule


class GPipeSchedule(BaselineSchedule):
    name = "gpipe"

    def warmup(self, dims: ParallelDims, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        return gpipe_warmup(dims, len(units))
