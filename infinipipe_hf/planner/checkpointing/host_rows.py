"""The host-memory rows of the checkpoint problem, and the repair that keeps an answer within them.

With a host tier (``cost.host_budget_bytes > 0``) a cell's host columns (:mod:`.problem`: ``offload``,
and ``offload_attn`` and ``offload_pair`` ahead of it) hold its offloaded layers, each keeping
``cost.host.layer_offload_bytes`` of its level in host memory while the unit is live (a pair
level's layer half an input: :func:`even_pairs` makes the answer's pair counts even, so the exact
bytes are never above the rows').  Every memory
point is then also a *packing* row ``sum host * y <= cap`` over those columns with ``cap = host
budget - the point's host base`` (states on the host, an offloaded KV store): raising a host
column can break it, so the covering arguments of the device rows (round up, greedy raise) do not
hold for it.  :func:`fit_host` repairs any answer instead: it demotes offloaded layers a level
(``offload_attn`` to ``offload_pair`` to ``offload``, ``offload`` to ``full``) at the worst host row, caps those variables there, and lets the
greedy cover the device rows again with the other levels; the MILP takes the rows as constraints
(:mod:`.lp`).  Rows that cannot bind (every live layer offloaded still fits) are dropped.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import OFFLOAD, OFFLOAD_ATTN, OFFLOAD_PAIR
from infinipipe_hf.planner.cost.model import GIB

HOST_SLACK_BYTES = 1.0
"""Bytes a host row may be over before it counts as broken (float noise)."""


@dataclass
class HostRows:
    """Host rows of one replica's problem: ``matrix @ columns <= cap``."""

    matrix: sparse.csr_matrix  # rows x columns: host bytes per offloaded layer (host columns only)
    cap: np.ndarray  # host budget minus the row's checkpoint-independent host bytes
    stage: np.ndarray
    action: list[Action]
    action_index: np.ndarray
    budget: float

    def over(self, columns: np.ndarray) -> np.ndarray:
        """Host bytes over budget at every row (<= 0 where it fits)."""
        return self.matrix @ columns - self.cap

    def fits(self, columns: np.ndarray) -> bool:
        return len(self.cap) == 0 or bool((self.over(columns) <= HOST_SLACK_BYTES).all())

    def block(self, rows: np.ndarray, cols: np.ndarray) -> "HostRows":
        """The rows ``rows`` over the columns ``cols`` (a stage's block of the problem)."""
        return HostRows(self.matrix[rows][:, cols].tocsr(), self.cap[rows], self.stage[rows],
                        [self.action[i] for i in rows.tolist()], self.action_index[rows], self.budget)

    def message(self, columns: np.ndarray, dp_rank: int) -> str:
        """Why the worst host row does not fit, with the fix."""
        over = self.over(columns)
        i = int(np.argmax(over))
        need = self.budget + over[i]
        return (f"dp replica {dp_rank}, stage {int(self.stage[i])} needs {need / GIB:.2f} GiB ({need:.0f} bytes) of "
                f"host memory at action {self.action[i]} (index {int(self.action_index[i])}) but the host budget is "
                f"{self.budget / GIB:.2f} GiB ({self.budget:.0f} bytes) per GPU; raise it (--host-memory-gib, "
                f"host_memory_gib), use more pipeline stages or a larger GPU memory budget")


def build_host_rows(budget: float, col_host: np.ndarray, r_row: np.ndarray, r_cell: np.ndarray,
                    host_base: np.ndarray, row_stage: np.ndarray, row_action: list[Action],
                    row_index: np.ndarray, cell_layers: np.ndarray) -> HostRows:
    """Host rows over the same points and live cells as the device rows (``r_row``, ``r_cell``:
    one entry per live cell of a row); ``col_host`` (cells x levels): the host bytes per layer each
    cumulative column adds beyond the next finer one (non-zero for the host levels only)."""
    n_rows = len(host_base)
    n_cells, nl = col_host.shape
    cols = (r_cell[:, None] * nl + np.arange(nl)).reshape(-1)
    matrix = sparse.csr_matrix((col_host.reshape(-1)[cols], (np.repeat(r_row, nl), cols)), shape=(n_rows, n_cells * nl))
    matrix.eliminate_zeros()
    cap = budget - host_base
    most = np.bincount(r_row, weights=col_host.sum(axis=1)[r_cell] * cell_layers[r_cell], minlength=n_rows)
    keep = np.flatnonzero(most > cap + HOST_SLACK_BYTES)
    return HostRows(matrix[keep].tocsr(), cap[keep], row_stage[keep], [row_action[i] for i in keep.tolist()],
                    row_index[keep], budget)


def host_var_rows(prob) -> sparse.csr_matrix:
    """Host rows x variables of ``prob`` (as :meth:`~.problem.ReplicaProblem.var_rows`)."""
    n = len(prob.col_var)
    m = sparse.csr_matrix((np.ones(n), (np.arange(n), prob.col_var)), shape=(n, prob.num_vars))
    return (prob.host.matrix @ m).tocsr()


def fit_host(prob, x: np.ndarray | None, greedy) -> np.ndarray | None:
    """``x`` (variable values covering the device rows) with offloaded layers demoted until every
    host row fits, the device rows covered again by ``greedy`` (:func:`.greedy.greedy_counts`)
    without raising a demoted variable; ``None`` when that fails (or ``x`` is None)."""
    if x is None or prob.host is None or not len(prob.host.cap):
        return x
    rows = host_var_rows(prob)
    capped = dataclasses.replace(prob, var_ub=prob.var_ub.copy())
    x = np.array(x, dtype=np.int64)
    heavier = np.full(prob.num_vars, -1, dtype=np.int64)  # the chain's next heavier variable
    has = prob.var_parent >= 0
    heavier[prob.var_parent[has]] = np.flatnonzero(has)
    for _ in range(int(prob.var_ub.sum()) + 1):
        over = rows @ x - prob.host.cap
        i = int(np.argmax(over))
        if over[i] <= HOST_SLACK_BYTES:
            return x
        lo, hi = rows.indptr[i], rows.indptr[i + 1]
        cols, vals = rows.indices[lo:hi], rows.data[lo:hi]
        usable = (x[cols] > 0) & (vals > 0)
        if not usable.any():
            return None
        left = over[i]
        for j in np.flatnonzero(usable)[np.argsort(-vals[usable], kind="stable")].tolist():
            v = int(cols[j])  # the biggest inputs first: fewest layers demoted
            drop = min(int(x[v]), math.ceil(left / vals[j]))
            x[v] -= drop
            capped.var_ub[v] = x[v]
            left -= drop * vals[j]
            h = int(heavier[v])
            while h >= 0 and x[h] > x[v]:  # the chain holds: no more heavier layers than this level's
                x[h] = capped.var_ub[h] = x[v]
                v, h = h, int(heavier[h])
            if left <= 0:
                break
        x = greedy(capped, x)
        if x is None:
            return None
    return None


def kv_offload_stages(plan, problems, slack: float) -> list[int]:
    """Stages whose device rows fail with every layer at its heaviest level while the plan keeps a
    KV store (some slice's sequence continues): those whose KV store should go to host memory."""
    if not any(plan.continues_after(s) for u in plan.units for s in u.segments):
        return []
    failing: set[int] = set()
    for prob in problems:
        over = prob.overshoot(prob.columns_from_vars(prob.var_ub))
        failing.update(prob.row_stage[over > slack].tolist())
    return sorted(failing)


def even_pairs(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` (layers per level of one cell) with an even ``offload_pair`` count: an odd pair
    run's last layer would keep its own input, above the rows' half.  It takes an ``offload_attn``
    layer as its partner when there is one, else it becomes an ``offload`` layer; either keeps the
    exact host bytes within the linear rows' (a kept attention output is at least half an input)
    and the device bytes the same (no host level keeps anything on the device)."""
    if counts.get(OFFLOAD_PAIR, 0) % 2 == 0:
        return counts
    out = dict(counts)
    if out.get(OFFLOAD_ATTN, 0):
        out[OFFLOAD_ATTN] -= 1
        out[OFFLOAD_PAIR] += 1
    else:
        out[OFFLOAD_PAIR] -= 1
        out[OFFLOAD] = out.get(OFFLOAD, 0) + 1
    return {lv: n for lv, n in out.items() if n}
