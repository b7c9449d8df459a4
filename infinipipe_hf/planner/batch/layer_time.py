"""``LayerTime``: the per-decoder-layer forward+backward time of a unit, ``a1 * pairs + a2 * tokens + b``.

The sequence processor cuts and packs with it, and the DP assignment balances replicas with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel


@dataclass(frozen=True)
class LayerTime:
    """Per-decoder-layer forward+backward time coefficients of a cost model."""

    a1: float  # seconds per attention pair (s^2 + 2 C s)
    a2: float  # seconds per token
    b: float  # seconds per unit (launch overhead, small-GEMM under-use)
    context_pairs: str = "band"  # how the profile's kernel counts a slice's context (UnitShape.of)

    @staticmethod
    def of(cost: CostModel) -> "LayerTime":
        f, w = cost.coefficients.layer_fwd, cost.coefficients.layer_bwd
        return LayerTime(f.attn_pair_s + w.attn_pair_s, f.token_s + w.token_s, f.fixed_s + w.fixed_s,
                         cost.profile.context_pairs)

    def segment(self, start: int, end: int) -> float:
        """Time of a segment without the per-unit constant ``b``."""
        return self.a1 * UnitShape.segment_pairs(start, end, self.context_pairs) + self.a2 * (end - start)

    def unit(self, segments: Sequence[Segment]) -> float:
        return self.b + sum(self.segment(s.start, s.end) for s in segments)
