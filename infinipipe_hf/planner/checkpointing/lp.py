"""The HiGHS side of the checkpoint solver: the LP relaxation rounded up, and the MILP.

Both take a :class:`~.problem.ReplicaProblem`'s covering rows ``rows @ y >= need`` (rows in GiB,
costs in milliseconds, which keeps HiGHS well scaled) and the chain rows ``y_v <= y_parent(v)``
of the finer levels, and with a host tier the host rows (packing: ``<= cap``, which rounding up
may break; the solver repairs, :func:`.host_rows.fit_host`).  Rounding the relaxation up keeps
every covering row covered (non-negative coefficients); closing the chains only raises
variables; the greedy then prunes what the rounding over-bought.
"""
from __future__ import annotations

import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from infinipipe_hf.planner.checkpointing.greedy import greedy_counts
from infinipipe_hf.planner.checkpointing.host_rows import host_var_rows
from infinipipe_hf.planner.checkpointing.problem import ReplicaProblem
from infinipipe_hf.planner.cost.model import GIB

# Margin asked of HiGHS on every row, in bytes, so its feasibility tolerance (1e-7 of a GiB-scaled
# row) and rounding of near-integral values cannot push a point over budget.
_MILP_MARGIN_BYTES = 4096.0
LP_TIME_LIMIT_S = 5.0
"""The LP relaxation runs to this wall-clock limit even when ``time_limit_s`` (which bounds the
MILP's branch and bound) is shorter: its rounding is the solver's main answer."""


def _chain_rows(prob: ReplicaProblem, used: np.ndarray | None = None) -> sparse.csr_matrix:
    """``y_v - y_parent(v) <= 0`` for every chained variable (over ``used`` columns if given)."""
    v = np.flatnonzero(prob.var_parent >= 0)
    n = prob.num_vars
    m = sparse.csr_matrix((np.r_[np.ones(len(v)), -np.ones(len(v))],
                           (np.r_[np.arange(len(v)), np.arange(len(v))], np.r_[v, prob.var_parent[v]])),
                          shape=(len(v), n))
    return m if used is None else m[:, used]


def close_chains(prob: ReplicaProblem, x: np.ndarray) -> np.ndarray:
    """Raise each variable's chain so ``y_v <= y_parent(v)`` (only raises: rows stay covered)."""
    has = np.flatnonzero(prob.var_parent >= 0)
    for _ in range(len(prob.levels) - 1):
        np.maximum.at(x, prob.var_parent[has], x[has])
    return x


def milp_deadline(time_limit_s: float) -> float:
    """When the branch and bound must stop (``time.perf_counter``); 0.0: no branch and bound."""
    return time.perf_counter() + time_limit_s if time_limit_s > 0 else 0.0


def share_until(deadline: float, share: float) -> float:
    """``share`` of the time left before ``deadline`` (of a millisecond at least); 0.0 without one."""
    return max(deadline - time.perf_counter(), 1e-3) * share if deadline else 0.0


def run_milp(prob: ReplicaProblem, time_limit_s: float, gap: float):
    """``scipy.optimize.milp`` (HiGHS) on the problem's binding rows and chains."""
    binding = prob.need > 0
    a = prob.var_rows()[binding] / GIB  # GiB rows and millisecond costs keep HiGHS well scaled
    lb = (prob.need[binding] + _MILP_MARGIN_BYTES) / GIB
    constraints = [LinearConstraint(a.tocsr(), lb, np.full(len(lb), np.inf))]
    if prob.chained:
        chain = _chain_rows(prob)
        constraints.append(LinearConstraint(chain, np.full(chain.shape[0], -np.inf), np.zeros(chain.shape[0])))
    if prob.host is not None and len(prob.host.cap):
        cap = np.maximum(prob.host.cap - _MILP_MARGIN_BYTES, np.minimum(prob.host.cap, 0.0)) / GIB
        constraints.append(LinearConstraint(host_var_rows(prob) / GIB, np.full(len(cap), -np.inf), cap))
    return milp(c=prob.var_cost_s * 1e3, integrality=np.ones(prob.num_vars),
                bounds=Bounds(np.zeros(prob.num_vars), prob.var_ub.astype(float)),
                constraints=constraints,
                options={"time_limit": max(time_limit_s, 1e-3), "mip_rel_gap": gap, "disp": False})


def milp_counts(prob: ReplicaProblem, time_limit_s: float, gap: float) -> tuple[np.ndarray | None, str]:
    """The MILP's variable values, rounded and chain-closed (None without a solution), and a note."""
    res = run_milp(prob, time_limit_s, gap)
    if res.x is None:
        return None, f"HiGHS: {res.message}"
    x = close_chains(prob, np.clip(np.round(res.x), 0, prob.var_ub).astype(np.int64))
    return x, ("" if res.status == 0 else f"HiGHS stopped early ({res.message})")


def lp_rounding(prob: ReplicaProblem, time_limit_s: float) -> tuple[np.ndarray | None, float]:
    """Rounded-up LP relaxation, pruned greedily, and the LP lower bound (seconds).

    Rows are covering constraints with non-negative coefficients, so rounding the relaxation up
    keeps every point within budget; pruning then removes what the rounding over-bought.  On
    batch-sized plans this lands within a few percent of the LP bound, often close enough to skip
    the branch and bound altogether.
    """
    binding = prob.need > 0
    a = prob.var_rows()[binding]
    # The rest stay 0 in any optimum, but for those that save time (``offload_attn`` over
    # ``offload``: no device bytes, less recompute, bound by the host rows) ...
    used_mask = (np.diff(a.tocsc().indptr) > 0) | (prob.var_cost_s < 0)
    for _ in range(len(prob.levels) - 1):  # ... and unless a used variable's chain needs them
        used_mask[prob.var_parent[used_mask & (prob.var_parent >= 0)]] = True
    used = np.flatnonzero(used_mask)
    a_ub = -(a[:, used] / GIB)
    b_ub = -prob.need[binding] / GIB
    if prob.chained:
        chain = _chain_rows(prob, used)
        keep = np.diff(chain.tocsr().indptr) > 0
        a_ub = sparse.vstack([a_ub, chain[keep]])
        b_ub = np.r_[b_ub, np.zeros(int(keep.sum()))]
    if prob.host is not None and len(prob.host.cap):
        a_ub = sparse.vstack([a_ub, host_var_rows(prob)[:, used] / GIB])
        b_ub = np.r_[b_ub, prob.host.cap / GIB]
    # Dual simplex: several times faster than interior point on these covering problems (a few
    # hundred rows over thousands of bounded columns), and its answer is a vertex as well.
    res = linprog(prob.var_cost_s[used] * 1e3, A_ub=a_ub.tocsr(), b_ub=b_ub,
                  bounds=np.column_stack([np.zeros(len(used)), prob.var_ub[used]]), method="highs-ds",
                  options={"time_limit": max(time_limit_s, 1e-3)})
    if res.x is None or res.status != 0:
        return None, 0.0
    up = np.zeros(prob.num_vars, dtype=np.int64)
    up[used] = np.minimum(np.ceil(res.x - 1e-6), prob.var_ub[used])
    return greedy_counts(prob, close_chains(prob, up)), float(res.fun) / 1e3

