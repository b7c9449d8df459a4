"""The checkpointing problem of one DP replica as a sparse linear system (docs/algorithms.md).

Cells are (stage, unit) pairs.  A cell's checkpointed-layer count ``c`` lowers the memory of every
point where its unit is live by ``slope * c`` (activation bytes are affine in ``c``).  Each memory
point of a stage's timeline (:mod:`.points`) is one row ``sum slope * c >= need`` with
``need = point bytes with nothing checkpointed - budget``.

Finer levels inside a layer (:mod:`infinipipe_hf.ir.levels`) give a cell one *column* per level
holding cumulative counts ``y_full <= y_keep_attn <= y_mlp <= y_mlp_act <= layers`` (a host tier puts
``y_offload_attn <= y_offload <= y_full`` first, bound by host rows: :mod:`.host_rows`); a row's
coefficient of ``y_l`` is what level ``l`` saves beyond the next finer one, never negative (0 for
``offload_attn`` over ``offload``: both keep nothing on the device), so the rows stay covering
constraints (raising any count never breaks one) and rounding an LP answer up keeps it feasible
once each chain is closed upwards.  The chains are the only other constraints.

Variables: ``sharing="cell"`` gives every column its own.  ``"diagonal"`` shares them along
backward-order diagonals (paper Alg. 2): the cell of stage ``p`` whose unit is the ``k``-th
backward there sits on diagonal ``d = k + (pp_degree - 1 - p)``, and cells on one diagonal run back
to back across stages, so recompute on one shows up as the same bubble on the others.  Stages may
hold different layer counts: the shared count would be ``min(x_d, layers_p)``, which is not
linear, so a diagonal gets one variable *per distinct layer count* among its stages (every cell
can still reach full checkpointing; the adaptive policy is feasible exactly when full
checkpointing is).  Trade-off (docs/algorithms.md): sharing makes the problem O(n + pp)
instead of O(n * pp) but forces recompute on stages with memory to spare; per-cell counts need
less recompute and their memory rows separate by stage (:meth:`ReplicaProblem.stage_blocks`),
which keeps them fast to solve.

SP rounds (:mod:`infinipipe_hf.ir.sp_rounds`): checkpointing is chosen per (stage, round) -- the
units of a round share their variables -- and every distinct SP rank gets the rows of its own
units (:mod:`.sp_round_cells`).

Only points that can bind are kept: a point whose live set is contained in another's and whose
base bytes (device or host) are not larger is dominated for every choice of counts (:mod:`.dominance`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy import sparse

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import FULL, HOST_LEVELS, check_levels, host_levels
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import rank_classes, rank_view
from infinipipe_hf.planner.checkpointing.dominance import undominated
from infinipipe_hf.planner.checkpointing.host_rows import HostRows, build_host_rows
from infinipipe_hf.planner.checkpointing.live_windows import live_windows
from infinipipe_hf.planner.checkpointing.points import MemoryPoint, memory_points
from infinipipe_hf.planner.checkpointing.sp_round_cells import RoundCells, slowest_member_pays
from infinipipe_hf.planner.cost.model import CostModel

SHARING = ("cell", "diagonal")


@dataclass
class ReplicaProblem:
    """Cells, their level columns, the variables and the binding memory rows of one DP replica.

    A *column* is one level of one cell, holding the cell's *cumulative* count of that level:
    ``y_full`` = whole layers, ``y_mlp`` = layers with at least the MLP recomputed, ``y_mlp_act``
    = layers with at least ``act * mul`` recomputed, so ``y_full <= y_mlp <= y_mlp_act <= layers``
    and a row's coefficient of ``y_l`` is the bytes level ``l`` saves beyond the next finer one
    (positive).  Without finer levels there is one column per cell, ``y_full``.
    """

    dp_rank: int
    levels: tuple[str, ...]  # the levels of a cell's columns, heaviest first (offload, if any, then full)
    cell_stage: np.ndarray  # int, per cell
    cell_unit: np.ndarray  # int, per cell
    cell_layers: np.ndarray  # layers of the cell's stage (upper bound of its counts)
    cell_layer_s: np.ndarray  # forward time of one layer on the unit: whole-layer recompute per count
    col_cell: np.ndarray  # cell of each column (columns of a cell are adjacent, heaviest first)
    col_level: np.ndarray  # index into ``levels`` of each column
    col_var: np.ndarray  # variable of each column
    col_cost_s: np.ndarray  # recompute seconds per unit of the column's cumulative count
    var_ub: np.ndarray  # layer count of the variable's cells
    var_cost_s: np.ndarray  # recompute seconds per unit of the variable (sum over its columns)
    var_parent: np.ndarray  # the variable that must be >= this one (next finer level), or -1
    rows: sparse.csr_matrix  # points x columns: bytes saved per unit of the cumulative count
    need: np.ndarray  # bytes over budget with nothing checkpointed (<= 0: fits already)
    row_stage: np.ndarray
    row_action: list[Action]
    row_action_index: np.ndarray
    budget: float
    stage_points: dict[int, list[MemoryPoint]]  # every point of every stage, for verification
    view_points: dict[int, list[tuple[Plan, list[MemoryPoint]]]] = field(default_factory=dict)
    """SP rounds: per stage, every rank view with its points (``stage_points`` is then empty)."""
    host: HostRows | None = None  # with a host tier: packing rows ``host.matrix @ columns <= host.cap``

    @property
    def num_vars(self) -> int:
        return len(self.var_ub)

    @property
    def chained(self) -> bool:
        """Some variable is bounded by another (finer levels are on)."""
        return bool((self.var_parent >= 0).any())

    def var_rows(self) -> sparse.csr_matrix:
        """Points x variables.  Exact because all columns of a variable have its layer count, so a
        column's count *is* the variable (and one point's cells lie on distinct diagonals anyway)."""
        n = len(self.col_var)
        m = sparse.csr_matrix((np.ones(n), (np.arange(n), self.col_var)), shape=(n, self.num_vars))
        return (self.rows @ m).tocsr()

    def columns_from_vars(self, x: np.ndarray) -> np.ndarray:
        return np.minimum(np.asarray(x)[self.col_var], self.cell_layers[self.col_cell])

    def overshoot(self, columns: np.ndarray) -> np.ndarray:
        """Bytes over budget at every kept point (<= 0 where it fits)."""
        return self.need - self.rows @ columns

    def recompute_s(self, columns: np.ndarray) -> float:
        return float(np.dot(columns, self.col_cost_s))

    def stage_blocks(self) -> list[tuple["ReplicaProblem", np.ndarray]]:
        """Independent sub-problems, one per stage, with each one's variables' indices here.

        Memory rows are per stage, so when no variable spans stages (``cell`` sharing) the
        problem separates; solving the blocks apart is several times faster than the whole (LP
        cost grows faster than its size).  With ``diagonal`` sharing: the whole problem, once."""
        var_stage = np.full(self.num_vars, -1, dtype=np.int64)
        col_stage = self.cell_stage[self.col_cell]
        var_stage[self.col_var] = col_stage
        if len(self.col_var) and (var_stage[self.col_var] != col_stage).any():
            return [(self, np.arange(self.num_vars))]
        blocks = []
        for stage in np.unique(self.cell_stage).tolist():
            cells = np.flatnonzero(self.cell_stage == stage)
            cols = np.flatnonzero(col_stage == stage)
            vars_ = np.flatnonzero(var_stage == stage)
            rows = np.flatnonzero(self.row_stage == stage)
            cell_new = np.full(len(self.cell_stage), -1, dtype=np.int64)
            cell_new[cells] = np.arange(len(cells))
            var_new = np.full(self.num_vars, -1, dtype=np.int64)
            var_new[vars_] = np.arange(len(vars_))
            parent = self.var_parent[vars_]
            blocks.append((ReplicaProblem(
                dp_rank=self.dp_rank, levels=self.levels, cell_stage=self.cell_stage[cells],
                cell_unit=self.cell_unit[cells], cell_layers=self.cell_layers[cells],
                cell_layer_s=self.cell_layer_s[cells], col_cell=cell_new[self.col_cell[cols]],
                col_level=self.col_level[cols], col_var=var_new[self.col_var[cols]],
                col_cost_s=self.col_cost_s[cols], var_ub=self.var_ub[vars_], var_cost_s=self.var_cost_s[vars_],
                var_parent=np.where(parent >= 0, var_new[np.maximum(parent, 0)], -1),
                rows=self.rows[rows][:, cols].tocsr(), need=self.need[rows], row_stage=self.row_stage[rows],
                row_action=[self.row_action[i] for i in rows.tolist()], row_action_index=self.row_action_index[rows],
                budget=self.budget, stage_points={stage: self.stage_points.get(stage, [])},
                view_points={stage: self.view_points.get(stage, [])},
                host=None if self.host is None else self.host.block(np.flatnonzero(self.host.stage == stage), cols)),
                vars_))
        return blocks

    def counts_per_level(self, columns: np.ndarray) -> np.ndarray:
        """Cells x levels: layers of each level per cell (differences of the cumulative columns)."""
        y = np.zeros((len(self.cell_stage), len(self.levels)), dtype=np.int64)
        y[self.col_cell, self.col_level] = columns
        out = y.copy()
        out[:, 1:] -= y[:, :-1]
        return out


@dataclass
class _Cells:
    """Per (stage, unit) cell, in the order cells are met: stage by stage, units by first action."""

    stage: list[int] = field(default_factory=list)
    unit: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    layer_s: list[float] = field(default_factory=list)
    key: list[tuple] = field(default_factory=list)
    """The variable the cell's counts share (before its level is added)."""
    saves: list[list[float]] = field(default_factory=list)
    """Bytes one layer at each level saves (heaviest first)."""
    redos: list[list[float]] = field(default_factory=list)
    """Seconds one layer at each level costs to redo."""
    zero_act: list[float] = field(default_factory=list)
    """Activation bytes with nothing checkpointed."""
    host: list[float] = field(default_factory=list)
    """Host bytes one offloaded layer keeps (0 without a host tier)."""


@dataclass
class _Rows:
    """The kept memory points of every stage, as chunks of (row, live cell) pairs."""

    row_chunks: list[np.ndarray] = field(default_factory=list)
    cell_chunks: list[np.ndarray] = field(default_factory=list)
    base_chunks: list[np.ndarray] = field(default_factory=list)
    stage_chunks: list[np.ndarray] = field(default_factory=list)
    index_chunks: list[np.ndarray] = field(default_factory=list)
    host_chunks: list[np.ndarray] = field(default_factory=list)
    action: list[Action] = field(default_factory=list)
    count: int = 0


def _add_cells(plan: Plan, base_cost: CostModel, dp_rank: int, p: int, levels: tuple[str, ...], sharing: str,
               cells: _Cells, unit_facts: dict[int, tuple], cell_here: dict[int, int],
               rounds: RoundCells) -> dict[int, int]:
    """Append the cells of stage ``p`` not in ``cell_here`` yet (unit id -> cell index there,
    updated and returned).  ``unit_facts`` caches each unit's segments, shape and one layer's
    recompute seconds across stages; ``rounds`` gives the units of one round one variable;
    ``levels``: a cell's column levels, heaviest first."""
    actions = plan.stage_actions(dp_rank, p)
    pp = plan.pp_degree
    layers = base_cost.num_layers(p)
    back_pos: dict[int, int] = {}
    for a in actions:
        if not a.is_forward and a.unit not in back_pos:
            back_pos[a.unit] = len(back_pos)
    for uid in dict.fromkeys(a.unit for a in actions):
        if uid in cell_here:
            continue
        cost = rounds.costs.get(uid, base_cost)
        lc = cost.levels if len(levels) > 1 else None
        if uid not in unit_facts:
            unit = plan.unit_by_id[uid]
            shape = cost.shape_of(unit.segments)
            unit_facts[uid] = (unit.segments, shape, cost.recompute_time(p, shape, 1))
        segments, shape, layer_s = unit_facts[uid]
        cell_here[uid] = len(cells.stage)
        cells.stage.append(p)
        cells.unit.append(uid)
        cells.layers.append(layers)
        cells.layer_s.append(layer_s)
        k = back_pos.get(uid)
        if sharing == "cell":
            cells.key.append(("c", p, rounds.first.get(uid, uid)))
        else:
            # A unit with no backward here (invalid plan) gets a variable of its own.
            cells.key.append(("d", k + (pp - 1 - p), layers) if k is not None else ("orphan", p, uid))
        tiled = {"mlp_tiled": True} if uid in plan.mlp_tile_tokens else {}  # kept layers keep no MLP intermediate
        a0 = cost.acts.unit_activation_bytes(p, segments, 0, **tiled)
        cells.zero_act.append(a0)
        full_save = a0 - cost.acts.unit_activation_bytes(p, segments, 1, **tiled)
        cells.saves.append([full_save if lv == FULL else lc.layer_saved_bytes(lv, p, segments, **tiled) for lv in levels])
        cells.redos.append([layer_s if lv == FULL else lc.layer_recompute_s(lv, shape) for lv in levels])
        cells.host.append([cost.host.layer_offload_bytes(p, segments, lv) if lv in HOST_LEVELS else 0.0 for lv in levels])
    return cell_here


def _add_rows(points: list[MemoryPoint], actions: list[Action], p: int, cell_here: dict[int, int],
              rows: _Rows) -> None:
    """Append stage ``p``'s undominated points as rows over the cells live there."""
    firsts, lasts = live_windows(points, actions)
    base = np.array([pt.base_bytes for pt in points])
    host = np.array([pt.host_bytes for pt in points])
    kept_mask = undominated(base, np.array(firsts), np.array(lasts))
    if len(host) and host.max() > host.min():  # a moving host base: keep its binding points too
        kept_mask |= undominated(host, np.array(firsts), np.array(lasts))
    kept = np.flatnonzero(kept_mask)
    lives = [points[i].live_units for i in kept]
    counts = np.fromiter(map(len, lives), dtype=np.int64, count=len(lives))
    rows.cell_chunks.append(np.fromiter((cell_here[u] for live in lives for u in live), dtype=np.int64,
                                        count=int(counts.sum())))
    rows.row_chunks.append(np.repeat(np.arange(rows.count, rows.count + len(kept)), counts))
    rows.base_chunks.append(base[kept])
    rows.host_chunks.append(host[kept])
    rows.stage_chunks.append(np.full(len(kept), p, dtype=np.int64))
    rows.index_chunks.append(np.array([points[i].action_index for i in kept], dtype=np.int64))
    rows.action.extend(actions[points[i].action_index] for i in kept)
    rows.count += len(kept)


def _cat(chunks: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(chunks).astype(dtype) if chunks else np.zeros(0, dtype=dtype)


def build_problem(plan: Plan, cost: CostModel, dp_rank: int, *, levels: Sequence[str] = (),
                  sharing: str = "diagonal", offload: bool | None = None) -> ReplicaProblem:
    """The replica's problem; ``levels``: finer levels allowed beside whole layers (any order); ``offload``:
    whether ``offload`` heads each chain (None: when the host tier is on); ``sharing``: ``diagonal``
    (a variable per backward diagonal and layer count, paper Alg. 2) or ``cell`` (one per cell)."""
    if sharing not in SHARING:
        raise ValueError(f"sharing={sharing!r} is not known; use one of {', '.join(SHARING)}")
    finer = check_levels(levels)
    offload = getattr(cost, "host_budget_bytes", 0.0) > 0 if offload is None else offload  # the host tier's levels
    all_levels = (host_levels(finer) if offload else ()) + (FULL, *finer)
    nl = len(all_levels)
    budget = cost.memory_budget_bytes
    cells, rows = _Cells(), _Rows()
    unit_facts: dict[int, tuple] = {}  # segments, shape, recompute seconds of one layer
    stage_points: dict[int, list[MemoryPoint]] = {}
    view_points: dict[int, list[tuple[Plan, list[MemoryPoint]]]] = {}
    rounds = RoundCells.of(plan, cost)
    # With SP rounds every distinct SP rank is constrained on its own units (its rank view).
    views = [rank_view(plan, r) for r in rank_classes(plan)] if rounds.first else [plan]
    for p in range(plan.pp_degree):
        cell_here: dict[int, int] = {}
        cache: dict | None = {} if rounds.first else None
        for view in views:
            _add_cells(view, cost, dp_rank, p, all_levels, sharing, cells, unit_facts, cell_here, rounds)
            points = memory_points(view, cost, dp_rank, p, cache)
            stage_points[p] = points if view is plan else []
            if view is not plan:  # rank views: verified per rank
                view_points.setdefault(p, []).append((view, points))
            if points:
                _add_rows(points, view.stage_actions(dp_rank, p), p, cell_here, rows)
    n_cells = len(cells.stage)
    # Columns: each cell's levels, heaviest first; cumulative coefficients are differences.
    save_arr = np.array(cells.saves, dtype=float).reshape(n_cells, nl)
    redo_arr, host_arr = (np.array(x, dtype=float).reshape(n_cells, nl) for x in (cells.redos, cells.host))
    col_save, col_redo, col_host = (a - np.concatenate([a[:, 1:], np.zeros((n_cells, 1))], axis=1)
                                    for a in (save_arr, redo_arr, host_arr))
    col_cell = np.repeat(np.arange(n_cells, dtype=np.int64), nl)
    col_level = np.tile(np.arange(nl, dtype=np.int64), n_cells)
    col_var, var_ub, var_parent = _variables(cells, col_cell, col_level, nl)
    if rounds.first:
        slowest_member_pays(cells.stage, cells.unit, rounds, col_redo)
    col_cost = col_redo.reshape(-1)
    var_cost = np.bincount(col_var, weights=col_cost, minlength=len(var_ub)).astype(float)
    r_row, r_cell = _cat(rows.row_chunks, np.int64), _cat(rows.cell_chunks, np.int64)
    zero_arr = np.array(cells.zero_act, dtype=float)
    need = _cat(rows.base_chunks, float) - budget + np.bincount(r_row, weights=zero_arr[r_cell], minlength=rows.count)
    # Every live cell contributes all its columns to the row.
    rr = np.repeat(r_row, nl)
    rc = (r_cell[:, None] * nl + np.arange(nl)).reshape(-1)
    matrix = sparse.csr_matrix((col_save.reshape(-1)[rc], (rr, rc)), shape=(rows.count, n_cells * nl))
    row_stage, row_index = _cat(rows.stage_chunks, np.int64), _cat(rows.index_chunks, np.int64)
    host = build_host_rows(cost.host_budget_bytes, col_host, r_row, r_cell, _cat(rows.host_chunks, float),
                           row_stage, rows.action, row_index, np.array(cells.layers)) if offload else None
    return ReplicaProblem(
        dp_rank=dp_rank, levels=all_levels, cell_stage=np.array(cells.stage, dtype=np.int64),
        cell_unit=np.array(cells.unit, dtype=np.int64), cell_layers=np.array(cells.layers, dtype=np.int64),
        cell_layer_s=np.array(cells.layer_s, dtype=float), col_cell=col_cell, col_level=col_level,
        col_var=col_var, col_cost_s=col_cost, var_ub=var_ub, var_cost_s=var_cost, var_parent=var_parent,
        rows=matrix, need=need, row_stage=row_stage, row_action=rows.action, row_action_index=row_index,
        budget=budget, stage_points=stage_points, view_points=view_points, host=host)


def _variables(cells: _Cells, col_cell: np.ndarray, col_level: np.ndarray,
               nl: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each column's variable, each variable's upper bound and chain parent (next finer level)."""
    col_key = cells.key if nl == 1 else [(key, j) for key in cells.key for j in range(nl)]
    keys = sorted(set(col_key), key=repr)
    var_of = {key: i for i, key in enumerate(keys)}
    col_var = np.array([var_of[k] for k in col_key], dtype=np.int64)
    layers_arr = np.array(cells.layers, dtype=np.int64)
    var_ub = np.zeros(len(keys), dtype=np.int64)
    var_ub[col_var] = layers_arr[col_cell]  # all columns of a variable share the layer count
    var_parent = np.full(len(keys), -1, dtype=np.int64)
    if nl > 1:
        finer_col = np.flatnonzero(col_level < nl - 1)
        var_parent[col_var[finer_col]] = col_var[finer_col + 1]
    return col_var, var_ub, var_parent

