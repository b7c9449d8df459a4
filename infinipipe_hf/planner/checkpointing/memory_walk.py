"""Memory timeline of one stage: the bytes alive at the peak of each of its actions, as arrays.

Design: a stage's memory at an action is a part independent of checkpointing (``base``: model
states, the KV store, the running action's working set with the context K/V copies its layer's
read holds, ``cost.acts.context_read_bytes``) plus the activations of the *live* units (forwarded
here, backward not finished, the running one included), each affine in its checkpoint counts
(whole layers and the finer levels of :mod:`infinipipe_hf.ir.levels`: unit -> level -> layers).
So every point is one linear constraint of the checkpoint solver, and the simulator and validator
evaluate any checkpoint choice without replaying the plan (:mod:`.points`: the per-point form).

Trade-off: ``base`` costs the backward working set as if the running unit had a checkpointed
layer (rebuilt next to its gradients), which keeps it linear; one layer too many for a unit with
none.  Where the stage checkpoints nothing at all the point values take it off again
(:meth:`StageTimeline.point_values`; the solver's ``none-needed`` answer is judged the same way).

SP sub-groups: the timeline of a plan with rounds is one SP rank's (:func:`infinipipe_hf.ir.rank_views.rank_view`);
each unit's bytes come from the cost of the sub-group it runs on (units in ``mlp_tile_tokens``: MLP in tiles).

KV store: a segment whose sequence continues holds ``cost.acts.kv_bytes(stage, length)`` from its
forward on the stage until the backward of the unit holding the sequence's first slice
(``start == 0``) finishes there (backward runs last slice first, so that is the last user).  On a
stage in the plan's ``offload_kv`` the store is in host memory (``host_base``) and the device
keeps ``cost.host.kv_device_share`` of it; offloaded layer inputs are :mod:`.host_peak`'s.

Speed: no per-point live tuples.  Base bytes are an array and, when every unit has one forward then
one backward on the stage (every planned plan), peaks are a cumulative sum over live intervals in
the per-action loop's order, bit-for-bit :func:`.points.point_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.checkpointing.live_windows import live_intervals
from infinipipe_hf.planner.cost.model import CostModel, unit_cost_map

LevelCounts = Mapping[int, Mapping[str, int]]
"""unit id -> finer checkpoint level -> layers, for one stage (a plan's ``checkpoint_levels[stage]``)."""


def finer_bytes(cost: CostModel, stage: int, segments, counts: Mapping[str, int] | None, tiled: bool = False) -> float:
    """Bytes the finer levels ``counts`` drop from a unit with ``segments`` (0.0 for none; ``tiled``: MLP in tiles)."""
    if not counts or not any(counts.values()):
        return 0.0
    return cost.levels.finer_saved_bytes(stage, segments, CheckpointMix.of(0, counts), **({"mlp_tiled": True} if tiled else {}))


def phase_model(cost: CostModel):
    """The cost model's phase model of working memory, or None (duck-typed test costs have none)."""
    return getattr(cost, "working", None)


def checkpoints_nothing(checkpoint_layers: Mapping[int, int], checkpoint_levels: LevelCounts | None) -> bool:
    """Whether a stage's checkpoint choice holds no layer and no finer level for any unit."""
    return not any(checkpoint_layers.values()) and not any(any(c.values()) for c in (checkpoint_levels or {}).values())


def rebuilt_bytes(cost: CostModel, stage: int, tokens: int, tiles: dict) -> float:
    """``cost.acts.rebuilt_bound_bytes`` (0 for stand-in cost models, which have none)."""
    rebuilt = getattr(cost.acts, "rebuilt_bound_bytes", None)
    return rebuilt(stage, tokens, **tiles) if rebuilt is not None else 0.0


def unit_tiles(plan: Plan, unit_id: int) -> dict:
    """The unit's ``mlp_tile_tokens`` / ``attention_tile_tokens`` in ``plan``, as ``working_bytes`` takes them."""
    return {k: n for k in ("mlp_tile_tokens", "attention_tile_tokens") if (n := getattr(plan, k).get(unit_id))}


@dataclass(eq=False)
class StageTimeline:
    """Array form of one stage's memory points (see the module docstring); built by :func:`stage_timeline`."""

    actions: list[Action]
    """The stage's action list (the plan's own list object)."""
    units: np.ndarray
    """Unit ids in order of first appearance (forward order when ``regular``)."""
    tokens: np.ndarray  # per unit, in ``units`` order
    slot: np.ndarray  # per action: index of its unit in ``units``
    forward: np.ndarray  # per action: True for a forward
    base: np.ndarray
    """Per action: the checkpoint-independent bytes of its point (``MemoryPoint.base_bytes``)."""
    regular: bool
    """Every unit has exactly one forward, then one backward, on the stage."""
    context_bytes: dict[int, float] = field(default_factory=dict)
    """Per unit slot with context: :meth:`StageActivations.context_bytes_per_layer` (others are 0)."""
    segments: list = field(default_factory=list)
    """Per unit slot: the unit's segments."""
    fpos: np.ndarray | None = None
    """``regular`` only: action index of each unit's forward (increasing)."""
    bpos: np.ndarray | None = None
    """``regular`` only: action index of each unit's backward."""
    slot_costs: dict[int, CostModel] = field(default_factory=dict)
    """Per unit slot run on an SP sub-group: that sub-group's cost (:meth:`CostModel.for_group`)."""
    host_base: np.ndarray | None = None
    """Per action: host bytes independent of checkpointing (states on the host, an offloaded KV store)."""
    tiled: frozenset = frozenset()
    """Unit slots whose MLP runs in tiles (the plan's ``mlp_tile_tokens``): kept layers keep no MLP intermediate."""
    rebuilt: np.ndarray | None = None
    """Per unit slot: ``acts.rebuilt_bound_bytes`` (None under the phase model, exact already)."""

    def __len__(self) -> int:
        return len(self.actions)

    def activations(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
                    checkpoint_levels: LevelCounts | None = None) -> np.ndarray:
        """``cost.acts.activation_bytes`` of every unit (``units`` order) under the checkpoint choices."""
        get = checkpoint_layers.get
        act, layers = cost.acts.activation_bytes, cost.layers_per_stage[stage]
        values = [act(stage, t, get(u, 0)) for u, t in zip(self.units.tolist(), self.tokens.tolist())]
        for k in sorted(set(self.slot_costs) | self.tiled):  # sub-group costs; MLPs in tiles (stand-ins take none)
            c, kw = self.slot_costs.get(k, cost), {"mlp_tiled": True} if k in self.tiled else {}
            values[k] = c.acts.activation_bytes(stage, int(self.tokens[k]), get(int(self.units[k]), 0), **kw)
        for k, extra in self.context_bytes.items():  # slices with context: K/V copies (and masks)
            values[k] += (layers - get(int(self.units[k]), 0)) * extra
        if checkpoint_levels:
            for k, u in enumerate(self.units.tolist()):
                values[k] -= finer_bytes(self.slot_costs.get(k, cost), stage, self.segments[k], checkpoint_levels.get(u), k in self.tiled)
        return np.array(values, dtype=float)

    def point_values(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
                     checkpoint_levels: LevelCounts | None = None) -> np.ndarray:
        """:func:`.points.point_bytes` of every point under ``checkpoint_layers`` (bit-identical)."""
        n = len(self.actions)
        if n == 0:
            return np.zeros(0)
        act = self.activations(cost, stage, checkpoint_layers, checkpoint_levels)
        base = self.base
        if phase_model(cost) is not None:
            base = base + self.working_corrections(cost, stage, checkpoint_layers, checkpoint_levels)
        elif self.rebuilt is not None and checkpoints_nothing(checkpoint_layers, checkpoint_levels):
            base = base - self.unrebuilt()
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
            corr[k] = self.slot_costs.get(k, cost).working.correction(stage, self.segments[k],
                                                                      checkpoint_layers.get(u, 0), levels.get(u))
        return np.where(self.forward, corr[self.slot, 0], corr[self.slot, 1])

    def unrebuilt(self) -> np.ndarray:
        """Per action: ``rebuilt`` at a backward, 0 at a forward (taken off only where the stage
        checkpoints nothing; elsewhere the solver's rows keep the bound, so they cover every plan)."""
        return np.where(self.forward, 0.0, self.rebuilt[self.slot])

    def peak(self, cost: CostModel, stage: int, checkpoint_layers: Mapping[int, int],
             checkpoint_levels: LevelCounts | None = None) -> float:
        """Max of :meth:`point_values` (the model states alone when the stage runs nothing)."""
        if not self.actions:
            return cost.acts.static_bytes(stage)
        return float(self.point_values(cost, stage, checkpoint_layers, checkpoint_levels).max())


@dataclass
class _UnitFacts:
    """Per unit of a stage (``units`` order): what its timeline needs of the unit."""

    tokens: np.ndarray
    kv_adds: list[list[tuple[int, float]]]  # K/V entering the store at the unit's forward: (sequence, bytes)
    frees: list[list[int]]  # sequences whose store the unit's backward frees (it holds their first slice)
    work_f: np.ndarray
    work_b: np.ndarray
    context_bytes: dict[int, float]
    segments: list
    rebuilt: np.ndarray


def _check_stage(plan: Plan, dp_rank: int, stage: int) -> None:
    if not 0 <= stage < plan.pp_degree:
        raise ValueError(f"stage {stage} out of range for pp_degree {plan.pp_degree}; use 0..{plan.pp_degree - 1}")
    if dp_rank not in plan.actions:
        raise ValueError(f"dp_rank {dp_rank} not in the plan (dp ranks {sorted(plan.actions)})")


def _slots(actions: list[Action]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit ids in order of first appearance, each action's index into them, and its direction."""
    n = len(actions)
    uid = np.fromiter((a.unit for a in actions), dtype=np.int64, count=n)
    fwd = np.fromiter((a.is_forward for a in actions), dtype=bool, count=n)
    uniq, first_idx, inv = np.unique(uid, return_index=True, return_inverse=True)
    order = np.argsort(first_idx, kind="stable")
    units = uniq[order]
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return units, rank[inv.reshape(-1)], fwd


def _unit_facts(plan: Plan, base_cost: CostModel, stage: int, units: np.ndarray,
                groups: Mapping[int, CostModel], cache: dict | None = None) -> _UnitFacts:
    """Tokens, K/V entering the store, sequences freed and working-set bounds of every unit
    (``groups``: the sub-group cost of units on SP sub-groups, :func:`unit_cost_map`; ``cache``:
    unit id -> these facts on this stage, shared by the rank views of one plan)."""
    by_id = plan.unit_by_id
    nu = len(units)
    facts = _UnitFacts(np.zeros(nu, dtype=np.int64), [None] * nu, [None] * nu,
                       np.empty(nu), np.empty(nu), {}, [], np.empty(nu))
    for k, u in enumerate(units.tolist()):
        one = cache.get(u) if cache is not None else None
        if one is None:
            unit = by_id.get(u)
            if unit is None:
                raise ValueError(f"stage {stage} runs unit {u}, which is not among the plan's units "
                                 f"{sorted(by_id)[:10]}...; build actions from plan.units")
            one = _memoized_unit(unit, groups.get(u, base_cost), stage, plan)
            if cache is not None:
                cache[u] = one
        extra, facts.kv_adds[k], facts.frees[k], facts.tokens[k], facts.work_f[k], facts.work_b[k], segs, \
            facts.rebuilt[k] = one
        if extra:
            facts.context_bytes[k] = extra
        facts.segments.append(segs)
    return facts


def _memoized_unit(unit, cost: CostModel, stage: int, plan: Plan) -> tuple:
    """:func:`_one_unit` through ``cost.unit_memo`` (none on stand-in costs), keyed by what the facts
    depend on beside the cost: the stage, the segments, which of them continue, the unit's tiles."""
    memo, segments = getattr(cost, "unit_memo", None), unit.segments
    if memo is None:
        return _one_unit(unit, cost, stage, plan)
    key = (stage, segments, tuple(s.end < plan.sequences[s.seq] for s in segments),
           plan.mlp_tile_tokens.get(unit.id), plan.attention_tile_tokens.get(unit.id))
    one = memo.get(key)
    if one is None:
        one = memo[key] = _one_unit(unit, cost, stage, plan)
    return one


def _one_unit(unit, cost: CostModel, stage: int, plan: Plan) -> tuple:
    """:func:`_unit_facts` of one unit: (context bytes, K/V added, sequences freed, tokens,
    forward and backward working bounds, segments); the unit's ``mlp_tile_tokens`` and
    ``attention_tile_tokens`` in ``plan``: the linear bound counts what they tile for a tile."""
    extra = cost.acts.context_bytes_per_layer(unit.segments)
    kv_adds, frees = [], []
    t = 0
    for seg in unit.segments:
        m = seg.end - seg.start
        t += m
        if seg.end < plan.sequences[seg.seq]:
            kv_adds.append((seg.seq, cost.acts.kv_bytes(stage, m)))
        if seg.start == 0:
            frees.append(seg.seq)  # the first slice's backward is the sequence's last
    # The running layer's context read: a phase model measured an unshared store's, not the exchange's buffers.
    measured = phase_model(cost) is not None
    read = getattr(cost.acts, "context_exchange_bytes" if measured else "context_read_bytes", lambda _: 0.0)(unit.segments)
    rebuilt = 0.0
    if not measured:  # the linear bound
        tiled = unit_tiles(plan, unit.id)
        work = [cost.acts.working_bytes(stage, t, int(b), backward=b, **tiled) + read for b in (False, True)]
        rebuilt = rebuilt_bytes(cost, stage, t, tiled)
    else:  # the phase model's bound over every checkpoint mix (exact values: point_values)
        work = [cost.working.bound(stage, t, extra, backward=b) + read for b in (False, True)]
    return extra, kv_adds, frees, t, work[0], work[1], unit.segments, rebuilt


def _kv_store(facts: _UnitFacts, slot: np.ndarray, fwd: np.ndarray) -> np.ndarray:
    """KV-store bytes at every action: the same float operations as a per-action loop, but only at
    the actions that change it (forwards adding K/V, backwards freeing a sequence that has some)."""
    n, nu = len(slot), len(facts.tokens)
    kv_adds, frees = facts.kv_adds, facts.frees
    kv_seqs = {q for adds in kv_adds for q, _ in adds}
    if not kv_seqs:
        return np.zeros(n)
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
    return np.where(idx >= 0, np.asarray(values)[np.maximum(idx, 0)], 0.0)


def stage_timeline(plan: Plan, cost: CostModel, dp_rank: int, stage: int,
                   cache: dict | None = None) -> StageTimeline:
    """:class:`StageTimeline` of ``plan.stage_actions(dp_rank, stage)``.  ``cache``: a dict shared
    by the calls for the rank views of one plan on one stage (each unit's facts computed once)."""
    _check_stage(plan, dp_rank, stage)
    actions = plan.stage_actions(dp_rank, stage)
    n = len(actions)
    units, slot, fwd = _slots(actions)
    if cache is not None and "groups" not in cache:
        cache["groups"] = unit_cost_map(plan, cost) if plan.sp_groups else {}
    groups = cache["groups"] if cache is not None else unit_cost_map(plan, cost) if plan.sp_groups else {}
    facts = _unit_facts(plan, cost, stage, units, groups, None if cache is None else cache.setdefault("facts", {}))
    work = np.where(fwd, facts.work_f[slot], facts.work_b[slot])
    kv, host = _kv_store(facts, slot, fwd), getattr(cost, "host", None)
    kv_host = stage in plan.offload_kv and host is not None  # the device keeps two layers' share
    base = cost.acts.static_bytes(stage) + (kv * host.kv_device_share(stage) if kv_host else kv) + work
    host_base = (kv if kv_host else np.zeros(n)) + (host.state_host_bytes(stage) if host is not None else 0.0)
    if phase_model(cost) is not None and n:
        ranks = np.array([plan.sub_group(u).size for u in units.tolist()])[slot] if groups else None
        base = base + cost.working.pipeline_buffers(stage, fwd, facts.tokens[slot], ranks)
    regular, fpos, bpos = live_intervals(len(units), slot, fwd)
    slot_costs = {k: groups[u] for k, u in enumerate(units.tolist()) if u in groups}
    tiled = frozenset(k for k, u in enumerate(units.tolist()) if u in plan.mlp_tile_tokens)
    return StageTimeline(actions, units, facts.tokens, slot, fwd, base, regular, facts.context_bytes,
                         facts.segments, fpos, bpos, slot_costs, host_base, tiled,
                         None if phase_model(cost) is not None else facts.rebuilt)
