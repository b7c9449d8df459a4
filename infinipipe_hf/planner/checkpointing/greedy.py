"""Greedy covering for the checkpoint problem: raise the best bytes-per-second variable at the worst
point until every point fits, then lower the most expensive variables as far as every point allows.

Design: rows are covering constraints (``rows @ y >= need``, non-negative coefficients), so
raising any variable never breaks a satisfied row, and the greedy is feasible whenever setting
every variable to its bound is (full checkpointing).  With finer checkpoint levels the variables
are cumulative counts chained per cell (``y_full <= y_mlp <= y_mlp_act <= layers``,
:mod:`.problem`): raising ``y_full`` past ``y_mlp`` drags ``y_mlp`` (and ``y_mlp_act``) up
with it, so a *move* is a variable plus the chain above it at the same value, scored by the bytes
the whole move saves at the worst point per recompute second.  Lowering a variable stops at the
one below it in its chain.  Without levels no variable has a chain and the moves are exactly the
single-variable steps of the plain greedy.

Trade-off: a move is priced by its first layer; a step of several layers may cross a point where
the chain above would join, which the next iteration then prices correctly.  The greedy is a
start and a fallback; the LP rounding and the MILP (:mod:`.lp`) improve on it.
"""
from __future__ import annotations

import math

import numpy as np

from infinipipe_hf.planner.checkpointing.problem import ReplicaProblem


def greedy_counts(prob: ReplicaProblem, x0: np.ndarray | None = None) -> np.ndarray | None:
    """Greedy variable values that fit, or ``None`` when even full checkpointing does not.

    Repeatedly take the worst violated point and raise, among its variables not at their bound,
    the move saving the most bytes there per recompute second, by as many layers as that point
    needs; then lower variables, the most expensive first, as far as every point allows.
    """
    a_rows = prob.var_rows()
    a_cols = a_rows.tocsc()
    x = np.zeros(prob.num_vars, dtype=np.int64) if x0 is None else np.array(x0, dtype=np.int64)
    over = prob.need - a_rows @ x
    cost_s = np.maximum(prob.var_cost_s, 1e-30)
    raise_ = _raise_chained if prob.chained else _raise_plain
    if not raise_(prob, a_rows, a_cols, x, over, cost_s):
        return None
    _lower(prob, a_cols, x, over)
    _raise_savers(prob, x)
    return x


def _raise_savers(prob: ReplicaProblem, x: np.ndarray) -> None:
    """Raise every variable that saves time (negative cost: ``offload_attn`` over ``offload_pair``
    over ``offload``) to the next finer one in its chain, within its bound: it costs device rows
    nothing, and the host rows are the caller's to repair (:func:`~.host_rows.fit_host`).  Once per
    chain link, so a raised variable lifts the heavier savers above it too."""
    savers = np.flatnonzero((prob.var_cost_s < 0) & (prob.var_parent >= 0))
    for _ in range(len(prob.levels) if len(savers) else 0):
        x[savers] = np.maximum(x[savers], np.minimum(x[prob.var_parent[savers]], prob.var_ub[savers]))


def _raise_plain(prob, a_rows, a_cols, x, over, cost_s) -> bool:
    while len(over):
        i = int(np.argmax(over))
        if over[i] <= 0:
            break
        lo, hi = a_rows.indptr[i], a_rows.indptr[i + 1]
        cols, vals = a_rows.indices[lo:hi], a_rows.data[lo:hi]
        room = prob.var_ub[cols] - x[cols]
        usable = (room > 0) & (vals > 0)
        if not usable.any():
            return False
        score = np.where(usable, vals / cost_s[cols], -np.inf)
        j = int(np.argmax(score))
        g = int(cols[j])
        step = int(min(room[j], math.ceil(over[i] / vals[j])))
        x[g] += step
        clo, chi = a_cols.indptr[g], a_cols.indptr[g + 1]
        over[a_cols.indices[clo:chi]] -= step * a_cols.data[clo:chi]
    return True


def _raise_chained(prob, a_rows, a_cols, x, over, cost_s) -> bool:
    parent = prob.var_parent
    depth = len(prob.levels) - 1
    dense = np.zeros(prob.num_vars)
    while len(over):
        i = int(np.argmax(over))
        if over[i] <= 0:
            break
        lo, hi = a_rows.indptr[i], a_rows.indptr[i + 1]
        cols, vals = a_rows.indices[lo:hi], a_rows.data[lo:hi]
        dense[cols] = vals
        # Each candidate move: the variable plus the chain above it sitting at the same value.
        gain, secs, top = vals.copy(), cost_s[cols].copy(), cols.copy()
        joined = np.ones(len(cols), dtype=bool)
        for _ in range(depth):
            up = parent[top]
            joined &= (up >= 0)
            safe = np.maximum(up, 0)
            joined &= x[safe] == x[cols]
            gain += np.where(joined, dense[safe], 0.0)
            secs += np.where(joined, cost_s[safe], 0.0)
            top = np.where(joined, safe, top)
        above = parent[top]
        limit = np.where(above >= 0, x[np.maximum(above, 0)], prob.var_ub[top])
        room = np.minimum(limit, prob.var_ub[cols]) - x[cols]  # a variable's own bound may be lower (capped)
        usable = (room > 0) & (gain > 0)
        dense[cols] = 0.0
        if not usable.any():
            return False
        j = int(np.argmax(np.where(usable, gain / secs, -np.inf)))
        step = int(min(room[j], math.ceil(over[i] / gain[j])))
        g, level = int(cols[j]), int(x[cols[j]])
        while g >= 0 and x[g] == level:  # the variable and the chain above it at its value
            x[g] += step
            clo, chi = a_cols.indptr[g], a_cols.indptr[g + 1]
            over[a_cols.indices[clo:chi]] -= step * a_cols.data[clo:chi]
            g = int(parent[g])
    return True


def _lower(prob: ReplicaProblem, a_cols, x: np.ndarray, over: np.ndarray) -> None:
    """Lower variables, the most expensive first, as far as every point (and the chain) allows."""
    child = np.full(prob.num_vars, -1, dtype=np.int64)
    has = prob.var_parent >= 0
    child[prob.var_parent[has]] = np.flatnonzero(has)
    for g in np.argsort(-prob.var_cost_s, kind="stable"):
        floor = x[child[g]] if child[g] >= 0 else 0
        if x[g] <= floor:
            continue
        clo, chi = a_cols.indptr[g], a_cols.indptr[g + 1]
        rows, vals = a_cols.indices[clo:chi], a_cols.data[clo:chi]
        pos = vals > 0
        spare = np.floor(-over[rows][pos] / vals[pos]) if pos.any() else np.array([x[g]])
        drop = int(max(0, min(x[g] - floor, spare.min())))
        if drop:
            x[g] -= drop
            over[rows] += drop * vals
