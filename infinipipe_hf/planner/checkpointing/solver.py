"""Per-(stage, unit) activation checkpointing: the least recompute that fits memory (docs/algorithms.md).

Design: each DP replica is an independent problem (its stages are its own GPUs), built by
:mod:`.problem` as covering rows ``rows @ y >= need`` over integer variables: one
per (stage, unit) cell (``sharing="cell"``) or shared along backward-order diagonals
(``"diagonal"``, the paper's), each cell with a chained count per checkpoint level when finer
levels inside a layer are allowed (:mod:`infinipipe_hf.ir.levels`).  ``adaptive`` minimises total
recompute seconds, per independent block (a stage, with per-cell counts):

1. nothing over budget with zero checkpointing (exactly, point by point: the rows count a rebuilt
   layer at every backward, :mod:`.memory_walk`): ``none-needed`` at once, no solver call;
2. the LP relaxation (HiGHS, :mod:`.lp`), rounded up, its chains closed and pruned greedily (``lp-rounding``),
   and -- without levels, where it is cheap, or when the LP fails -- the greedy; the better kept.
   Within ``mip_rel_gap`` of the LP bound it is returned (``milp``: proven near-optimal);
3. otherwise, when ``time_limit_s > 0``, ``scipy.optimize.milp`` (HiGHS) runs for the rest of it;
   its answer is used when better, else the candidate (its name as method, the message says why).
   ``time_limit_s=0`` (``PlanOptions``' default) stops at step 2, so no clock changes the plan.
   The greedy is feasible whenever full checkpointing is, since every row only involves its own cells.

``greedy`` is step 1 plus the greedy only (no LP, no MILP), for the many trial plans of pipeline
grouping; ``none``, ``full`` and ``uniform`` are the static whole-layer settings baselines use.

With a host tier (``cost.host_budget_bytes > 0``) the adaptive and greedy policies may also
offload (:mod:`.host_rows`: every answer is repaired to fit the host rows), and a stage whose
device rows fail even then gets its KV store in host memory (the plan's ``offload_kv``).

Trade-off (docs/algorithms.md): the rounded LP lands within a few percent of the LP bound, so
the LP always runs (up to ``lp.LP_TIME_LIMIT_S``) and ``time_limit_s`` bounds only the branch and
bound; the formulation matters more (diagonal-shared counts force recompute on stages with memory
to spare).  Every answer is re-checked against the full memory timeline (:mod:`.points`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from infinipipe_hf.ir.levels import FULL, HOST_LEVELS, CheckpointMix, check_levels, check_solver_time_limit
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import has_sub_groups
from infinipipe_hf.planner.checkpointing.greedy import greedy_counts
from infinipipe_hf.planner.checkpointing.host_peak import stage_host_peak_bytes
from infinipipe_hf.planner.checkpointing.host_rows import HOST_SLACK_BYTES, even_pairs, fit_host, kv_offload_stages
from infinipipe_hf.planner.checkpointing.lp import LP_TIME_LIMIT_S, lp_rounding, milp_counts, milp_deadline, share_until
from infinipipe_hf.planner.checkpointing.points import fits_unchecked, stage_peak_bytes
from infinipipe_hf.planner.checkpointing.problem import SHARING, ReplicaProblem, build_problem
from infinipipe_hf.planner.checkpointing.sp_round_cells import round_recompute_seconds
from infinipipe_hf.planner.checkpointing.static_policies import static_cells
from infinipipe_hf.planner.cost.model import GIB, CostModel

POLICIES = ("adaptive", "greedy", "none", "full", "uniform")
_SLACK_BYTES = 1.0  # bytes a solver tolerance may leave over budget before it is a violation (float noise)


@dataclass
class CheckpointSolution:
    checkpoint_layers: dict[int, dict[int, int]]
    """stage -> unit id -> checkpointed layers; every unit of every stage present."""
    recompute_time_s: float
    """Sum over stages and units of ``cost.recompute_time``."""
    feasible: bool
    method: str
    """``milp``, ``lp-rounding``, ``greedy``, ``none-needed``, ``full``, ``uniform`` or ``infeasible``."""
    message: str = ""
    checkpoint_levels: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)
    """stage -> unit id -> finer level -> layers, non-zero entries only (the plan's key)."""
    offload_kv: list[int] = field(default_factory=list)
    """Stages whose KV store the answer keeps in host memory (also set on the plan solved)."""



def _device_fits(prob: ReplicaProblem, columns: np.ndarray) -> bool:
    return len(prob.need) == 0 or bool((prob.overshoot(columns) <= _SLACK_BYTES).all())


def _fits(prob: ReplicaProblem, columns: np.ndarray) -> bool:
    return _device_fits(prob, columns) and (prob.host is None or prob.host.fits(columns))


def _heaviest(prob: ReplicaProblem) -> str:
    offload = prob.levels[0] in HOST_LEVELS
    return "every layer checkpointed" + (" and what it keeps in host memory" if offload else "")


def _infeasible_message(prob: ReplicaProblem, columns: np.ndarray, what: str) -> str:
    over = prob.overshoot(columns)
    i = int(np.argmax(over))
    needed = prob.budget + over[i]
    return (f"dp replica {prob.dp_rank}, stage {int(prob.row_stage[i])} does not fit with {what}: at action "
            f"{prob.row_action[i]} (index {int(prob.row_action_index[i])}) it needs {needed / GIB:.2f} GiB "
            f"({needed:.0f} bytes) but the budget is {prob.budget / GIB:.2f} GiB ({prob.budget:.0f} bytes); "
            f"use more pipeline stages, smaller units (more slices per long sequence) or a larger memory budget"
            + ("" if prob.host is not None else
               ", or give a host memory budget (--host-memory-gib, host_memory_gib) to offload layer inputs"))


def _adaptive(prob: ReplicaProblem, time_limit_s: float, gap: float) -> tuple[np.ndarray, bool, str, str]:
    """Variable values, feasible, method, message for one replica."""
    zeros = np.zeros(prob.num_vars, dtype=np.int64)
    stop = _unfit(prob)
    if stop is not None:
        return stop
    if not (prob.need > 0).any():
        return zeros, True, "none-needed", ""
    deadline = time.perf_counter() + time_limit_s
    rounded, bound = lp_rounding(prob, max(time_limit_s, LP_TIME_LIMIT_S))
    rounded = fit_host(prob, rounded, greedy_counts)
    candidates = [] if rounded is None else [("lp-rounding", rounded)]
    if rounded is None or not prob.chained:
        # The plain greedy is vectorised and cheap; the chained one (finer levels) moves one
        # variable per Python iteration and the LP rounding does better, so with levels it is
        # the fallback only.
        greedy = fit_host(prob, greedy_counts(prob), greedy_counts)
        candidates += [] if greedy is None else [("greedy", greedy)]
    if not candidates:  # the host rows defeated the repairs: only the MILP can still find a mix
        x, note = milp_counts(prob, max(deadline - time.perf_counter(), LP_TIME_LIMIT_S), gap)
        if x is not None and _fits(prob, prob.columns_from_vars(x)):
            return x, True, "milp", note
        return prob.var_ub.copy(), False, "infeasible", prob.host.message(prob.columns_from_vars(prob.var_ub),
                                                                           prob.dp_rank)
    name, best = min(candidates, key=lambda c: float(c[1] @ prob.var_cost_s))
    best_s = float(best @ prob.var_cost_s)
    assert best is not None and _fits(prob, prob.columns_from_vars(best))
    if rounded is not None and best_s - bound <= gap * best_s:
        return best, True, "milp", f"{name} is within {gap:g} of the LP bound"
    if time_limit_s <= 0:
        return best, True, name, ""  # no branch and bound asked for: reproducible
    if time.perf_counter() >= deadline:
        return best, True, name, f"{name} solution used (no time left for the MILP)"
    x, note = milp_counts(prob, deadline - time.perf_counter(), gap)
    if x is not None and not _fits(prob, prob.columns_from_vars(x)):
        # Solver tolerance left a point over budget: repair from its answer.
        x = fit_host(prob, greedy_counts(prob, x), greedy_counts)
        note = (note + "; " if note else "") + "repaired after rounding"
    if x is not None and float(x @ prob.var_cost_s) <= best_s:
        return x, True, "milp", note
    why = "no solver solution" if x is None else "better than the solver's incumbent"
    note = (note + "; " if note else "") + f"{name} solution used ({why})"
    return best, True, name, note


def _unfit(prob: ReplicaProblem):
    """The infeasible answer of a replica that cannot fit at all (device rows with every layer at
    the heaviest level, host rows with nothing offloaded), else None."""
    top = prob.columns_from_vars(prob.var_ub)
    if not _device_fits(prob, top):
        return prob.var_ub.copy(), False, "infeasible", _infeasible_message(prob, top, _heaviest(prob))
    if prob.host is not None and not prob.host.fits(np.zeros_like(top)):
        return prob.var_ub.copy(), False, "infeasible", prob.host.message(np.zeros_like(top), prob.dp_rank)
    return None


def _adaptive_blocks(prob: ReplicaProblem, time_limit_s: float, gap: float) -> tuple[np.ndarray, bool, str, str]:
    """:func:`_adaptive` on each independent block (stage) of ``prob``, the time shared by size."""
    blocks = prob.stage_blocks()
    if len(blocks) == 1:
        return _adaptive(prob, time_limit_s, gap)
    deadline = milp_deadline(time_limit_s)
    x = np.zeros(prob.num_vars, dtype=np.int64)
    methods, notes, failed = [], [], []
    sizes = np.array([max(b.num_vars, 1) for b, _ in blocks], dtype=float)
    for i, (block, index) in enumerate(blocks):
        left = share_until(deadline, sizes[i] / sizes[i:].sum())
        xb, ok, method, note = _adaptive(block, left, gap)
        x[index] = xb
        methods.append(method)
        if not ok:
            failed.append(note)
        elif note:
            notes.append(f"stage {int(block.cell_stage[0])}: {note}")
    if failed:
        return prob.var_ub.copy(), False, "infeasible", "; ".join(failed)
    method = next((m for m in ("greedy", "lp-rounding", "milp") if m in methods), "none-needed")
    return x, True, method, "; ".join(notes)


def _greedy_only(prob: ReplicaProblem) -> tuple[np.ndarray, bool, str, str]:
    stop = _unfit(prob)
    if stop is not None:
        return stop
    if not (prob.need > 0).any():
        return np.zeros(prob.num_vars, dtype=np.int64), True, "none-needed", ""
    x = fit_host(prob, greedy_counts(prob), greedy_counts)
    if x is None:  # the repair is a heuristic: the MILP may still find a mix within both budgets
        x, _ = milp_counts(prob, LP_TIME_LIMIT_S, 0.05)
        if x is not None and _fits(prob, prob.columns_from_vars(x)):
            return x, True, "milp", "greedy could not fit the host rows"
        top = prob.columns_from_vars(prob.var_ub)
        return prob.var_ub.copy(), False, "infeasible", prob.host.message(top, prob.dp_rank)
    return x, True, "greedy", ""


def solve_checkpointing(plan: Plan, cost: CostModel, *, policy: str = "adaptive", time_limit_s: float = 2.0,
                        mip_rel_gap: float = 0.01, levels: tuple[str, ...] | list[str] = (),
                        sharing: str = "diagonal", verify: bool = True) -> CheckpointSolution:
    """Checkpointed layers per (stage, unit) for ``plan`` under ``cost.memory_budget_bytes``.

    ``time_limit_s``: wall-clock limit of the adaptive policy's branch and bound, 0 for none (what
    the planner passes by default, ``PlanOptions.solver_time_limit_s``: reproducible plans).
    ``levels``: finer levels inside a layer the adaptive and greedy policies may use beside whole
    layers (``keep_attn``, ``mlp``, ``mlp_act``; :mod:`infinipipe_hf.ir.levels`); the static
    policies use whole layers only.  ``sharing``: ``diagonal`` shares counts along backward
    diagonals (paper Alg. 2), ``cell`` gives every (stage, unit) its own (:mod:`.problem`).

    With a host tier the adaptive and greedy policies may offload layer inputs, and when the plan
    does not fit otherwise they set ``plan.offload_kv`` to the stages whose KV store must go to host
    memory (the solution's ``offload_kv``; the plan is left as it was when that does not fit either).
    ``verify=False`` skips re-walking a feasible answer's timeline (search candidates: simulated anyway).
    """
    levels = _check_arguments(plan, cost, policy, levels, sharing, time_limit_s, mip_rel_gap)
    deadline = milp_deadline(time_limit_s)
    adaptive = policy in ("adaptive", "greedy")
    levels = levels if adaptive else ()  # static settings are whole layers (Megatron / Seq1F1B style)
    offload = adaptive and getattr(cost, "host_budget_bytes", 0.0) > 0
    problems, cells, feasible, methods, messages = _solve(plan, cost, policy, levels, sharing, offload, deadline,
                                                          mip_rel_gap)
    kv = kv_offload_stages(plan, problems, _SLACK_BYTES) if offload and not feasible and not plan.offload_kv else []
    if kv:
        plan.offload_kv = kv
        second = _solve(plan, cost, policy, levels, sharing, offload, deadline, mip_rel_gap)
        if second[2]:
            problems, cells, feasible, methods, messages = second
        else:
            plan.offload_kv = []
    checkpoint_layers, checkpoint_levels = _assemble(plan, problems, cells)
    recompute = recompute_seconds(plan, cost, checkpoint_layers, checkpoint_levels)
    if feasible:
        if verify:
            _verify(plan, cost, problems, checkpoint_layers, checkpoint_levels)
        # The weakest replica's method describes the plan: greedy < lp-rounding < milp < none-needed.
        method = next((m for m in ("greedy", "lp-rounding", "milp") if m in methods),
                      methods[0] if methods else "none-needed")
    else:
        method = "infeasible"
    return CheckpointSolution(checkpoint_layers, recompute, feasible, method, "; ".join(messages),
                              checkpoint_levels, list(plan.offload_kv))


def _solve(plan: Plan, cost: CostModel, policy: str, levels: tuple[str, ...], sharing: str, offload: bool,
           deadline: float, gap: float):
    """Problems, column values, feasible, methods and messages of ``policy`` on ``plan`` as it is."""
    problems = [build_problem(plan, cost, r, levels=levels, sharing=sharing, offload=offload)
                for r in sorted(plan.actions)]
    if policy in ("adaptive", "greedy"):
        unchecked = [fits_unchecked(plan, cost, p, _SLACK_BYTES) for p in problems]
        cells, feasible, methods, messages = _solved_cells(problems, policy, deadline, gap, unchecked)
    else:
        cells, methods = static_cells(problems, policy)
        feasible, messages = _static_fits(problems, cells, policy)
    return problems, cells, feasible, methods, messages


def _check_arguments(plan: Plan, cost: CostModel, policy: str, levels, sharing: str, time_limit_s: float,
                     mip_rel_gap: float) -> tuple[str, ...]:
    """``ValueError`` for an unknown policy, level or sharing, a cost model not built for the
    plan's layout, or a bad time limit or gap; returns the levels in canonical order."""
    if policy not in POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; use one of {', '.join(POLICIES)}")
    levels = check_levels(levels)
    if sharing not in SHARING:
        raise ValueError(f"sharing={sharing!r} is not known; use one of {', '.join(SHARING)}")
    if cost.dims.pp_degree != plan.pp_degree:
        raise ValueError(f"cost model is for pp_degree={cost.dims.pp_degree} but the plan has pp_degree="
                         f"{plan.pp_degree}; build the CostModel with the plan's pp_degree")
    if plan.layers_per_stage and list(plan.layers_per_stage) != list(cost.layers_per_stage):
        raise ValueError(f"plan has layers_per_stage={plan.layers_per_stage} but the cost model "
                         f"{cost.layers_per_stage}; build the CostModel with the plan's layer split")
    check_solver_time_limit(time_limit_s, "time_limit_s")
    if not 0 <= mip_rel_gap < 1:
        raise ValueError(f"need 0 <= mip_rel_gap < 1, got {mip_rel_gap}")
    return levels


def _solved_cells(problems: list[ReplicaProblem], policy: str, deadline: float, gap: float, unchecked: list[bool]):
    """Column values, feasible, methods and messages of the adaptive or greedy policy (nothing checkpointed
    on the ``unchecked`` replicas), the time left shared equally by the replicas still to solve."""
    cells: list[np.ndarray] = []  # per replica: column values
    feasible, methods, messages = True, [], []
    for i, prob in enumerate(problems):
        left = share_until(deadline, 1.0 / (len(problems) - i))
        if unchecked[i]:
            x, ok, method, note = np.zeros(prob.num_vars, dtype=np.int64), True, "none-needed", ""
        elif policy == "greedy":
            x, ok, method, note = _greedy_only(prob)
        else:
            x, ok, method, note = _adaptive_blocks(prob, left, gap)
        cells.append(prob.columns_from_vars(x))
        feasible &= ok
        methods.append(method)
        if note:
            messages.append(f"dp {prob.dp_rank}: {note}" if len(problems) > 1 else note)
    return cells, feasible, methods, messages


def _static_fits(problems: list[ReplicaProblem], cells: list[np.ndarray], policy: str) -> tuple[bool, list[str]]:
    """Whether a static setting fits every replica, and a message for each that does not."""
    what = {"none": "no checkpointing", "full": "every layer checkpointed",
            "uniform": "every layer checkpointed (no uniform count fits)"}[policy]
    feasible, messages = True, []
    for prob, cc in zip(problems, cells):
        if not _fits(prob, cc):
            feasible = False
            messages.append(_infeasible_message(prob, cc, what))
    return feasible, messages


def _assemble(plan: Plan, problems: list[ReplicaProblem], columns: list[np.ndarray]):
    """``checkpoint_layers`` (every unit of every stage) and ``checkpoint_levels`` (non-zero only)."""
    out: dict[int, dict[int, int]] = {s: {u.id: 0 for u in plan.units} for s in range(plan.pp_degree)}
    finer: dict[int, dict[int, dict[str, int]]] = {}
    for prob, cc in zip(problems, columns):
        per_level = prob.counts_per_level(cc)
        full = prob.levels.index(FULL)
        for s, u, row in zip(prob.cell_stage.tolist(), prob.cell_unit.tolist(), per_level.tolist()):
            out[s][u] = int(row[full])
            extra = even_pairs({lv: int(n) for lv, n in zip(prob.levels, row) if n and lv != FULL})
            if extra:
                finer.setdefault(s, {})[u] = extra
    return out, finer


def recompute_seconds(plan: Plan, cost: CostModel, ck: dict[int, dict[int, int]],
                      levels: dict[int, dict[int, dict[str, int]]] | None = None) -> float:
    """Recompute seconds of a whole step under whole-layer counts ``ck`` and finer ``levels``."""
    by_id = plan.unit_by_id
    shapes = {u.id: cost.shape_of(u.segments) for u in plan.units}
    if has_sub_groups(plan):
        return round_recompute_seconds(plan, cost, shapes, ck, levels or {})
    total = float(sum(cost.recompute_time(s, shapes[u], c) for s, per in ck.items() for u, c in per.items()
                      if c and u in by_id))
    for s, per in (levels or {}).items():
        for u, counts in per.items():
            if u in by_id:
                total += cost.levels.finer_recompute_s(shapes[u], CheckpointMix.of(0, counts))
    return total


def _verify(plan: Plan, cost: CostModel, problems: list[ReplicaProblem], ck: dict[int, dict[int, int]],
            levels: dict[int, dict[int, dict[str, int]]]) -> None:
    """Every stage of every replica within budget on its full timeline (not just kept points)."""
    for prob in problems:
        for s, points in prob.stage_points.items():
            views = prob.view_points.get(s) or [(plan, points)]  # SP rounds: every rank's own points
            peak = max(stage_peak_bytes(view, cost, prob.dp_rank, s, ck[s], checkpoint_levels=levels.get(s, {}),
                                        points=pts) for view, pts in views)
            assert peak <= cost.memory_budget_bytes + _SLACK_BYTES, (prob.dp_rank, s, peak, cost.memory_budget_bytes)
            if prob.host is not None:
                host = stage_host_peak_bytes(plan, cost, prob.dp_rank, s, levels.get(s, {}))
                assert host <= cost.host_budget_bytes + HOST_SLACK_BYTES, (prob.dp_rank, s, host, cost.host_budget_bytes)
