"""Memory timeline of one stage: the bytes alive at the peak of each of its actions.

Design: a stage's memory at an action splits into a part that does not depend on checkpointing
(``base_bytes``: model states, the KV store, the working set of the running action) and the
activations of the *live* units (forwarded on this stage, backward not finished, the running
one included), each affine in its checkpointed-layer counts (whole layers, and the finer levels
of planner/checkpoint_levels.py, passed as ``checkpoint_levels``: unit -> level -> layers).  A :class:`MemoryPoint` keeps the two
apart, so the checkpoint solver turns every point into one linear constraint and the simulator
and validator evaluate any checkpoint choice with :func:`point_bytes` without replaying the plan.

Trade-off: the backward working set is costed as if the running unit had at least one
checkpointed layer (its activations are rebuilt next to their gradients).  That over-estimates
units with no checkpointing by one layer's activations, but keeps ``base_bytes`` independent of
checkpoint choices, which is what makes every point a linear constraint.  The running unit's
activations count in full during its forward and backward (their peak is at the layer boundary).

KV store: a segment whose sequence continues holds ``cost.kv_bytes(stage, length)`` from its
forward on the stage until the backward of the unit holding the sequence's first slice
(``start == 0``) finishes there (backward runs last slice first, so that is the last user).

Speed: the planner's hot paths (checkpoint problem, simulator, validator) never build the
per-point live tuples, which cost O(actions x units in flight) per stage.  They use a
:class:`StageTimeline` instead: the base bytes of every point as an array, and, when every unit
has exactly one forward followed by one backward on the stage (every plan the planner builds),
each unit's live interval ``[forward index, backward index]``.  Peaks then are a cumulative sum
of +activation at forwards and -activation after backwards, evaluated in the same order as the
per-action loop, so every number is bit-for-bit what :func:`memory_points` and
:func:`point_bytes` give.  Irregular action lists (tests of broken plans) take the plain loops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.ir.plan import Plan

LevelCounts = Mapping[int, Mapping[str, int]]
"""unit id -> finer checkpoint level -> layers, for one stage (a plan's ``checkpoint_levels[stage]``)."""


def _finer_bytes(cost: CostModel, stage: int, segments, counts: Mapping[str, int] | None) -> float:
    """Bytes the finer levels ``counts`` drop from a unit with ``segments`` (0.0 for none)."""
    if not counts or not any(counts.values()):
        return 0.0
    return cost.levels.finer_saved_bytes(stage, segments, CheckpointMix.of(0, counts))


def _phases(cost: CostModel):
    """The cost model's phase model of working memory, or None (duck-typed test costs have none)."""
    return getattr(cost, "working", None)


def _working_correction(cost: CostModel, stage: int, segments, full: int,
                        finer: Mapping[str, int] | None) -> tuple[float, float]:
    """(forward, backward): the phase model's working bytes of a unit at this mix minus its bound."""
    w = cost.working
    tokens = sum(s.end - s.start for s in segments)
    ctx = cost.context_bytes_per_layer(segments)
    mix = CheckpointMix.of(full, finer)
    return (w.excess(stage, segments, mix, False) - w.bound(stage, tokens, ctx, False),
            w.excess(stage, segments, mix, True) - w.bound(stage, tokens, ctx, True))


@dataclass(frozen=True)
class MemoryPoint:
    """Memory of one stage at the peak of one of its actions."""

    action_index: int
    """Index into ``plan.stage_actions(dp_rank, stage)``."""
    base_bytes: float
    """Model states + KV store + working set of the running action; independent of checkpointing."""
    live_units: tuple[int, ...]
    """Units whose activations are held at that point (forward done or running, backward not
    finished), the running one included, in the order of their forwards."""
    running_unit: int | None = None
    """The unit of the action at this point (its working memory is part of ``base_bytes``)."""
    forward: bool = True
    """Whether that action is a forward."""


@dataclass(eq=False)
class StageTimeline:
    """Array form of one stage's memory points (see the module docstring); built by :func:`stage_timeline`."""

    actions: list[Action]
    """The stage's action list (the plan's own list object)."""
    units: np.ndarray
    """Unit ids in order of first appearance (forward order when ``regular``)."""
    tokens: np.ndarray
    """Tokens per unit, in ``units`` order."""
    slot: np.ndarray
    """Per action: index of its unit in ``units``."""
    forward: np.ndarray
    """Per action: True for a forward."""
    base: np.ndarray
    """Per action: ``base_bytes`` of its point (exactly :func:`memory_points`' value)."""
    regular: bool
    """Every unit has exactly one forward, then one backward, on the stage."""
    context_bytes: dict[int, float] = field(default_factory=dict)
    """Per unit slot with context: :meth:`CostModel.context_bytes_per_layer` (others are 0)."""
    segments: list = field(default_factory=list)
    """Per unit slot: the unit's segments."""
    fpos: np.ndarray | None = None
    """``regular`` only: action index of each unit's forward (increasing)."""
    bpos: np.ndarray | None = None
    """``regular`` only: action index of each unit's backward."""

    def __len__(self) -> int:
        return len(self.actions)

    def activations(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
                    checkpoint_levels: LevelCounts | None = None) -> np.ndarray:
        """``cost.activation_bytes`` of every unit (``units`` order) under ``checkpoint_layers``
        (and ``checkpoint_levels``)."""
        get = checkpoint_layers.get
        act = cost.activation_bytes
        layers = cost.layers_per_stage[stage]
        values = [act(stage, t, get(u, 0)) for u, t in zip(self.units.tolist(), self.tokens.tolist())]
        for k, extra in self.context_bytes.items():  # slices with context: K/V copies (and masks)
            values[k] += (layers - get(int(self.units[k]), 0)) * extra
        if checkpoint_levels:
            for k, u in enumerate(self.units.tolist()):
                values[k] -= _finer_bytes(cost, stage, self.segments[k], checkpoint_levels.get(u))
        return np.array(values, dtype=float)

    def point_values(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
                     checkpoint_levels: LevelCounts | None = None) -> np.ndarray:
        """:func:`point_bytes` of every point under ``checkpoint_layers`` (bit-identical)."""
        n = len(self.actions)
        if n == 0:
            return np.zeros(0)
        act = self.activations(cost, stage, checkpoint_layers, checkpoint_levels)
        base = self.base
        if _phases(cost) is not None:
            base = base + self.working_corrections(cost, stage, checkpoint_layers, checkpoint_levels)
        if self.regular:
            # Interleave "+act at the forward" and "-act after the backward" in action order, so
            # the cumulative sum performs the same float operations as the per-action loop.
            delta = np.zeros(2 * n)
            delta[2 * self.fpos] = act
            delta[2 * self.bpos + 1] = -act
            return base + np.cumsum(delta)[0::2]
        values = np.empty(n)
        held: dict[int, float] = {}
        live_sum = 0.0
        for j, (k, fw) in enumerate(zip(self.slot.tolist(), self.forward.tolist())):
            if k not in held:
                held[k] = float(act[k])
                live_sum += held[k]
            values[j] = float(base[j]) + live_sum
            if not fw:
                live_sum -= held.pop(k)
        return values

    def working_corrections(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
                            checkpoint_levels: LevelCounts | None = None) -> np.ndarray:
        """Per action: the exact working memory of its unit's levels minus the bound in ``base``
        (<= 0; only with a measured phase model, ``cost.working``)."""
        levels = checkpoint_levels or {}
        corr = np.zeros((len(self.units), 2))
        for k, u in enumerate(self.units.tolist()):
            corr[k] = _working_correction(cost, stage, self.segments[k], checkpoint_layers.get(u, 0), levels.get(u))
        return np.where(self.forward, corr[self.slot, 0], corr[self.slot, 1])

    def peak(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
             checkpoint_levels: LevelCounts | None = None) -> float:
        """Max of :meth:`point_values` (the model states alone when the stage runs nothing)."""
        if not self.actions:
            return cost.static_bytes(stage)
        return float(self.point_values(cost, stage, checkpoint_layers, checkpoint_levels).max())

    def windows(self) -> tuple[np.ndarray, np.ndarray]:
        """:func:`.live_windows.live_windows` as arrays (``regular`` timelines only)."""
        assert self.regular, "live windows of an irregular timeline: use live_windows"
        n = len(self.actions)
        firsts = np.arange(n)
        lasts = np.arange(n)
        fpos, bpos = self.fpos.tolist(), self.bpos.tolist()
        # firsts[j]: latest forward among the units live at j -- paint intervals by rising forward
        # index, later paints win.  lasts[j]: earliest backward among them -- paint by falling
        # backward index.
        for f, b in zip(fpos, bpos):
            firsts[f:b + 1] = f
        for k in np.argsort(-self.bpos, kind="stable").tolist():
            lasts[fpos[k]:bpos[k] + 1] = bpos[k]
        return firsts, lasts


def _check_stage(plan: Plan, dp_rank: int, stage: int) -> None:
    if not 0 <= stage < plan.pp_degree:
        raise ValueError(f"stage {stage} out of range for pp_degree {plan.pp_degree}; use 0..{plan.pp_degree - 1}")
    if dp_rank not in plan.actions:
        raise ValueError(f"dp_rank {dp_rank} not in the plan (dp ranks {sorted(plan.actions)})")


def stage_timeline(plan: Plan, cost: CostModel, dp_rank: int, stage: int) -> StageTimeline:
    """:class:`StageTimeline` of ``plan.stage_actions(dp_rank, stage)``."""
    _check_stage(plan, dp_rank, stage)
    actions = plan.stage_actions(dp_rank, stage)
    n = len(actions)
    uid = np.fromiter((a.unit for a in actions), dtype=np.int64, count=n)
    fwd = np.fromiter((a.kind == "F" for a in actions), dtype=bool, count=n)
    uniq, first_idx, inv = np.unique(uid, return_index=True, return_inverse=True)
    order = np.argsort(first_idx, kind="stable")
    units = uniq[order]
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    slot = rank[inv.reshape(-1)]

    # Per unit: tokens, K/V entering the store at its forward, sequences whose store it frees.
    by_id = plan.unit_by_id
    seq_len = plan.sequences
    nu = len(units)
    tokens = np.zeros(nu, dtype=np.int64)
    kv_adds: list[list[tuple[int, float]]] = [[] for _ in range(nu)]
    frees: list[list[int]] = [[] for _ in range(nu)]
    work_f = np.empty(nu)
    work_b = np.empty(nu)
    context_bytes: dict[int, float] = {}
    segments: list = []
    for k, u in enumerate(units.tolist()):
        unit = by_id.get(u)
        if unit is None:
            raise ValueError(f"stage {stage} runs unit {u}, which is not among the plan's units "
                             f"{sorted(by_id)[:10]}...; build actions from plan.units")
        extra = cost.context_bytes_per_layer(unit.segments)
        if extra:
            context_bytes[k] = extra
        t = 0
        for seg in unit.segments:
            m = seg.end - seg.start
            t += m
            if seg.end < seq_len[seg.seq]:
                kv_adds[k].append((seg.seq, cost.kv_bytes(stage, m)))
            if seg.start == 0:
                frees[k].append(seg.seq)  # the first slice's backward is the sequence's last
        tokens[k] = t
        segments.append(unit.segments)
        if _phases(cost) is None:
            work_f[k] = cost.working_bytes(stage, t, 0, backward=False)
            work_b[k] = cost.working_bytes(stage, t, 1, backward=True)
        else:  # the phase model's bound over every checkpoint mix (exact values: point_values)
            work_f[k] = cost.working.bound(stage, t, extra, backward=False)
            work_b[k] = cost.working.bound(stage, t, extra, backward=True)

    # KV store: the same float operations as a per-action loop, but only at the actions that
    # change it (forwards adding K/V, backwards freeing a sequence that has some).
    kv_seqs = {q for adds in kv_adds for q, _ in adds}
    kv = np.zeros(n)
    if kv_seqs:
        frees_kv = [[q for q in fr if q in kv_seqs] for fr in frees]
        has_add = np.fromiter((bool(x) for x in kv_adds), dtype=bool, count=nu)
        has_free = np.fromiter((bool(x) for x in frees_kv), dtype=bool, count=nu)
        events = np.flatnonzero(np.where(fwd, has_add[slot], has_free[slot]))
        kv_by_seq: dict[int, float] = {}
        kv_total = 0.0
        change_at: list[int] = []
        values: list[float] = []
        slot_l = slot.tolist()
        fwd_l = fwd.tolist()
        for j in events.tolist():
            k = slot_l[j]
            if fwd_l[j]:
                # The new K/V exist as soon as the forward has run its first layer.
                for q, b in kv_adds[k]:
                    kv_by_seq[q] = kv_by_seq.get(q, 0.0) + b
                    kv_total += b
                change_at.append(j)
            else:
                for q in frees_kv[k]:
                    kv_total -= kv_by_seq.pop(q, 0.0)
                change_at.append(j + 1)  # freed after the backward's own point
            values.append(kv_total)
        idx = np.searchsorted(np.asarray(change_at), np.arange(n), side="right") - 1
        kv = np.where(idx >= 0, np.asarray(values)[np.maximum(idx, 0)], 0.0)
    base = cost.static_bytes(stage) + kv + np.where(fwd, work_f[slot], work_b[slot])
    if _phases(cost) is not None and n:
        base = base + cost.working.pipeline_buffers(stage, fwd, tokens[slot])

    fpos = bpos = None
    regular = False
    if n:
        f_units, b_units = slot[fwd], slot[~fwd]
        if len(f_units) == nu and len(b_units) == nu:
            fpos = np.full(nu, -1, dtype=np.int64)
            bpos = np.full(nu, -1, dtype=np.int64)
            fpos[f_units] = np.flatnonzero(fwd)
            bpos[b_units] = np.flatnonzero(~fwd)
            regular = bool((fpos >= 0).all() and (bpos >= 0).all() and (fpos < bpos).all())
        if not regular:
            fpos = bpos = None
    return StageTimeline(actions, units, tokens, slot, fwd, base, regular, context_bytes, segments, fpos, bpos)


def memory_points(plan: Plan, cost: CostModel, dp_rank: int, stage: int) -> list[MemoryPoint]:
    """One :class:`MemoryPoint` per action of ``plan.stage_actions(dp_rank, stage)``, in order."""
    return timeline_points(stage_timeline(plan, cost, dp_rank, stage))


def timeline_points(tl: StageTimeline) -> list[MemoryPoint]:
    """The :class:`MemoryPoint` list of a :class:`StageTimeline` (what :func:`memory_points` returns)."""
    units = tl.units.tolist()
    live: dict[int, None] = {}  # insertion-ordered set: forwards arrive in time order
    points: list[MemoryPoint] = []
    for i, (k, fw, base) in enumerate(zip(tl.slot.tolist(), tl.forward.tolist(), tl.base.tolist())):
        u = units[k]
        if fw:
            live[u] = None
            points.append(MemoryPoint(i, base, tuple(live), u, True))
        else:
            # A backward without its forward is the validator's to report; count the unit live
            # while it runs so the point is still conservative.
            live.setdefault(u, None)
            points.append(MemoryPoint(i, base, tuple(live), u, False))
            del live[u]
    return points


def point_bytes(point: MemoryPoint, plan: Plan, cost: CostModel, stage: int,
                checkpoint_layers: Mapping[int, int], checkpoint_levels: LevelCounts | None = None) -> float:
    """Bytes of ``point`` on ``stage`` when unit ``u`` checkpoints ``checkpoint_layers.get(u, 0)`` layers
    (and the finer levels ``checkpoint_levels.get(u)``)."""
    by_id = plan.unit_by_id
    levels = checkpoint_levels or {}
    total = point.base_bytes
    if _phases(cost) is not None and point.running_unit is not None:
        u = point.running_unit
        total += _working_correction(cost, stage, by_id[u].segments, checkpoint_layers.get(u, 0),
                                     levels.get(u))[0 if point.forward else 1]
    for uid in point.live_units:
        segs = by_id[uid].segments
        total += (cost.unit_activation_bytes(stage, segs, checkpoint_layers.get(uid, 0))
                  - _finer_bytes(cost, stage, segs, levels.get(uid)))
    return total


def stage_peak_bytes(plan: Plan, cost: CostModel, dp_rank: int, stage: int,
                     checkpoint_layers: Mapping[int, int] | None = None, *,
                     checkpoint_levels: LevelCounts | None = None,
                     points: list[MemoryPoint] | None = None,
                     timeline: StageTimeline | None = None) -> float:
    """Peak over the stage's actions of :func:`point_bytes` (the plan's ``checkpoint_layers`` and
    ``checkpoint_levels`` when ``checkpoint_layers`` is not given; else none of the finer levels
    unless ``checkpoint_levels`` is).

    ``points`` may pass :func:`memory_points` of the same stage, or ``timeline`` its
    :func:`stage_timeline`, when the caller has them.  Keeps a running sum of live activations
    instead of summing every point's live set, so it is linear in the number of actions even for
    GPipe-like schedules where everything is live.
    """
    if checkpoint_layers is None:
        checkpoint_layers = plan.checkpoint_layers.get(stage, {})
        if checkpoint_levels is None:
            checkpoint_levels = plan.checkpoint_levels.get(stage, {})
    levels = checkpoint_levels or {}
    if points is None:
        if timeline is None:
            timeline = stage_timeline(plan, cost, dp_rank, stage)
        assert timeline.actions is plan.stage_actions(dp_rank, stage), "timeline is not this stage's"
        return timeline.peak(cost, stage, checkpoint_layers, levels)
    if not points:
        return cost.static_bytes(stage)
    actions = plan.stage_actions(dp_rank, stage)
    assert len(points) == len(actions), "points are not this stage's"
    by_id = plan.unit_by_id
    act: dict[int, float] = {}
    live_sum = 0.0
    peak = float("-inf")
    for p in points:
        a = actions[p.action_index]
        if a.unit not in act:
            segs = by_id[a.unit].segments
            act[a.unit] = (cost.unit_activation_bytes(stage, segs, checkpoint_layers.get(a.unit, 0))
                           - _finer_bytes(cost, stage, segs, levels.get(a.unit)))
            live_sum += act[a.unit]
        base = p.base_bytes
        if _phases(cost) is not None:
            base += _working_correction(cost, stage, by_id[a.unit].segments, checkpoint_layers.get(a.unit, 0),
                                        levels.get(a.unit))[0 if a.is_forward else 1]
        peak = max(peak, base + live_sum)
        if not a.is_forward:
            live_sum -= act.pop(a.unit)
    return peak
