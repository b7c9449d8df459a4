"""Closed-form estimate of a 1F1B pipeline's time, for the planner's inner searches.

Pipeline grouping prices O(G^2) candidate pipelines and the slice-count search several whole
plans; building, checkpoint-solving and simulating each is far too slow for that.
``PipelineEstimator`` precomputes per-unit quantities once per replica and prices any contiguous
run of units with a few numpy prefix-sum operations:

    time ~ sum over units of the bottleneck stage's F + B
         + (pp - 1) x the F + B of an average unit            (fill and drain)
         + recompute forced by the worst in-flight window      (excess bytes x seconds per byte)

In steady 1F1B a stage keeps a constant number of units in flight (its warm-up plus one); the
first and last stages bound the memory pressure.  A chain's K/V stays until its first slice's
backward, so every chain touching a window holds all its forwarded K/V.  Relieving a window costs
its average recompute per byte saved by checkpointing.  With SP rounds the units priced are the
rounds (``members``), each at its slowest and most memory-hungry unit.  The estimate only ranks
candidates: every plan that is kept is solved and simulated exactly.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from infinipipe_hf.ir.units import Unit
from infinipipe_hf.planner.cost.model import CostModel

SAFETY = 0.95
"""Share of the memory budget the estimate plans into: it ignores some transient terms the exact
memory model counts, so it aims a little lower (a ranking built with ``safety=1`` sees the
candidates this margin alone rules out, :func:`~infinipipe_hf.planner.schedules.epp_units.margin_estimate`)."""


class PipelineEstimator:
    """Prices contiguous runs ``units[a:b]`` of one replica's units in forward order (with
    ``safety=math.inf`` memory is ignored: no window is priced, nor its per-unit bytes computed)."""

    def __init__(self, units: Sequence[Unit], cost: CostModel, lengths: Sequence[int],
                 members: dict[int, list[tuple[Unit, CostModel]]] | None = None, safety: float = SAFETY):
        self.cost = cost
        self.units = list(units)
        self.position = {u.id: i for i, u in enumerate(self.units)}
        pp = cost.dims.pp_degree
        self.chain_start = _chain_starts(self.units, lengths)
        chain_len: dict[int, int] = {}
        for start in self.chain_start:
            chain_len[start] = chain_len.get(start, 0) + 1
        self.chain_len = chain_len
        each = _Each(self.units, cost, members)
        totals = each(lambda c, u, sh: c.compute.slowest_stage_time(sh))
        self.total_prefix = np.concatenate([[0.0], np.cumsum(totals)])
        self.stages = sorted({0, pp - 1}) if math.isfinite(safety) else []  # inf: memory ignored
        self.per_stage = {}
        self._per_stage_lists = {}
        for st in self.stages:
            layers = cost.num_layers(st)
            act = each(lambda c, u, sh: c.acts.unit_activation_bytes(st, u.segments, 0))
            kv = each(lambda c, u, sh: c.acts.kv_bytes(st, sum(s.length for s in u.segments if s.end < lengths[s.seq])))
            save = each(lambda c, u, sh: c.acts.unit_checkpoint_saving(st, u.segments) * layers)
            redo = each(lambda c, u, sh: c.recompute_time(st, sh, layers))
            work = each(lambda c, u, sh: c.acts.working_bytes(st, u.num_tokens, 1, backward=True)
                        + (c.acts.context_read_bytes(u.segments) if hasattr(c.acts, "context_read_bytes") else 0.0))
            self.per_stage[st] = (
                np.concatenate([[0.0], np.cumsum(act)]), np.concatenate([[0.0], np.cumsum(kv)]),
                np.concatenate([[0.0], np.cumsum(save)]), np.concatenate([[0.0], np.cumsum(redo)]),
                np.asarray(work), cost.acts.static_bytes(st) - safety * cost.memory_budget_bytes)
            self._per_stage_lists[st] = tuple(x.tolist() for x in self.per_stage[st][:5])
        self._chain_start_arr = np.asarray(self.chain_start)

    def time_of_ids(self, ids: Sequence[int]) -> float:
        a = self.position[ids[0]]
        b = self.position[ids[-1]] + 1
        assert b - a == len(ids), "estimates need a contiguous run of units"
        return self.time(a, b)

    def time(self, a: int, b: int) -> float:
        n = b - a
        if n <= 0:
            return 0.0
        pp = self.cost.dims.pp_degree
        steady = float(self.total_prefix[b] - self.total_prefix[a])
        fill_drain = (pp - 1) * steady / n
        n_split = self.chain_len[self.chain_start[a]]
        recompute = 0.0
        for st in self.stages:
            width = min(n, pp - st + n_split - 1)
            extra = self._window_recompute(a, b, st, width)
            if math.isinf(extra):
                return math.inf
            recompute = max(recompute, extra)
        return steady + fill_drain + recompute

    def _window_recompute(self, a: int, b: int, stage: int, width: int) -> float:
        if b - a - width < SMALL_WINDOW_COUNT:
            return self._few_windows_recompute(a, b, stage, width)
        act, kv, save, redo, work, fixed = self.per_stage[stage]
        ends = np.arange(a + width, b + 1)
        starts = ends - width
        chain_from = np.maximum(self._chain_start_arr[starts], a)
        excess = (fixed + (act[ends] - act[starts]) + (kv[ends] - kv[chain_from]) + work[ends - 1])
        hot = excess > 0
        if not hot.any():
            return 0.0
        saved = (save[ends] - save[starts])[hot]
        if (excess[hot] > saved).any():
            return math.inf
        worst = float(np.max(excess[hot] * (redo[ends] - redo[starts])[hot] / saved))
        # Windows overlap: the worst one, spread over the pipeline's length, approximates the
        # recompute on the critical path.
        return worst * (b - a) / width

    def _few_windows_recompute(self, a: int, b: int, stage: int, width: int) -> float:
        """:meth:`_window_recompute` in plain floats, the same operations in the same order: a
        few windows cost less this way than in numpy's per-call overhead."""
        act, kv, save, redo, work = self._per_stage_lists[stage]
        fixed = self.per_stage[stage][5]
        chain_start = self.chain_start
        worst = None
        for end in range(a + width, b + 1):
            start = end - width
            excess = fixed + (act[end] - act[start]) + (kv[end] - kv[max(chain_start[start], a)]) + work[end - 1]
            if not excess > 0:
                continue
            saved = save[end] - save[start]
            if excess > saved:
                return math.inf
            value = excess * (redo[end] - redo[start]) / saved
            if worst is None or value > worst:
                worst = value
        if worst is None:
            return 0.0
        return worst * (b - a) / width


SMALL_WINDOW_COUNT = 32
"""Up to this many windows the estimate prices them in plain floats (:meth:`PipelineEstimator.
_few_windows_recompute`), beyond it with numpy arrays."""


class _Each:
    """A per-unit figure of every unit; with SP rounds (``members``: round -> its units and their
    sub-group costs) a round's is the largest of its units' (they run side by side, and the
    busiest rank's memory bounds the stage's)."""

    def __init__(self, units: list[Unit], cost: CostModel, members):
        self.units, self.cost, self.members = units, cost, members
        if members is None:
            self.shapes = [cost.shape_of(u.segments) for u in units]
        else:
            self.shapes = {m.id: cost.shape_of(m.segments) for ms in members.values() for m, _ in ms}

    def __call__(self, fn) -> list[float]:
        """``fn(cost, unit, shape)`` per unit (or the max over a round's units)."""
        if self.members is None:
            return [fn(self.cost, u, sh) for u, sh in zip(self.units, self.shapes)]
        return [max(fn(c, m, self.shapes[m.id]) for m, c in self.members[u.id]) for u in self.units]


def pipeline_time_estimate(units: Sequence[Unit], cost: CostModel, lengths: Sequence[int]) -> float:
    """Estimate for one pipeline of ``units`` (convenience; builds a one-off estimator)."""
    return PipelineEstimator(units, cost, lengths).time(0, len(units)) if units else 0.0


def _chain_starts(units: Sequence[Unit], lengths: Sequence[int]) -> list[int]:
    """For each unit, the forward position of the first unit of its slice chain."""
    starts: list[int] = []
    open_at: dict[int, int] = {}
    for pos, u in enumerate(units):
        begin = min((open_at[s.seq] for s in u.segments if s.start > 0 and s.seq in open_at), default=pos)
        starts.append(begin)
        for s in u.segments:
            if s.end < lengths[s.seq]:
                open_at.setdefault(s.seq, begin)
            else:
                open_at.pop(s.seq, None)
    return starts
