"""``flexsp``: the seed system FlexSP (Wang et al., ASPLOS 2025): per-step heterogeneous SP groups.

What it models: ZeRO-3 states over all GPUs (:class:`~.flat_cost.Zero3States`); every step, the
batch is split into micro-batches (rounds) and, for each round, the GPUs are split into Ulysses
SP groups of power-of-two sizes, possibly all different, and every sequence of the round goes to
one group, whole, packed with the group's others (all-to-all inside each group, two-level when a
group spans nodes).  Long sequences get large groups (memory), short ones small groups (no
all-to-all), and the assignment balances the groups' times (:mod:`.flexsp_solver`).

The steps of one batch:

1. *Sequence blaster* (FlexSP section 5): ``M`` rounds, sequences longest first, each into the
   round with the fewest tokens so far, so the rounds' memory is balanced and each gets some of
   the long sequences.  ``M`` is searched from the least the GPUs' memory allows upward.
2. Each round's groups and assignment: :func:`~.flexsp_solver.greedy_groups` (default, milliseconds)
   or :func:`~.flexsp_solver.milp_groups` (FlexSP's MILP on length buckets, HiGHS, with a time
   limit; the greedy answer is kept when the MILP's is not better).
3. One uniform checkpoint count for the step, tuned over a few values (every layer's share in
   quarters); each count sets the tokens a group may hold.

Simplified against the paper: the blaster balances tokens rather than solving jointly with the
rounds; the checkpoint count is a searched knob (FlexSP fixes one per run); a round lasts as long
as its slowest group (ZeRO-3 gathers synchronise the groups layer by layer).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.flexsp_solver import RoundProblem, greedy_groups, milp_groups
from infinipipe_hf.planner.alternatives.round_plan import (AlternativeResult, GroupRun, RoundPlan,
    simulate_rounds)
from infinipipe_hf.planner.alternatives.search import longest_fit_hint, resolve_checkpointing

NAME = "flexsp"
ATTENTION = "ulysses"
EXTRA_ROUNDS = 3
"""Round counts searched beyond the least that memory allows."""
SOLVERS = ("greedy", "milp")
MILP_BUCKETS = 16
"""Length buckets of the MILP (FlexSP buckets sequences to keep the MILP small)."""


def round_problem(lengths: Sequence[int], seqs: Sequence[int], cost: FlatCost, checkpoint: int,
                  sizes: Sequence[int]) -> RoundProblem:
    """The solver's view of one round: per size the affine time split and the token cap.

    A group's time is affine in its attention pairs, and in its tokens once every GPU of the group
    holds whole tokens (the SP cost splits ``ceil(tokens / size)`` per GPU).  So the token slope is
    the secant from no tokens to the group's token cap: exact at both ends and in between up to
    rounding.  (The slope from 0 to 1 token, the ceil's corner, was up to 37x too small on a
    32-GPU group: the solvers then saw large groups as nearly free and packed long rounds into
    them; ``test_round_model_prices_groups_as_the_simulation``.)"""
    fixed, per_seq, caps = {}, {}, {}
    lens = np.asarray([lengths[s] for s in seqs], dtype=float)
    for g in sizes:
        group = cost.group(ATTENTION, g)
        caps[g] = max(0, group.max_tokens(checkpoint, cost.room_bytes) - (g - 1))  # padding headroom
        span = max(g, caps[g] // g * g)  # whole tokens per GPU
        base = sum(group.times(0.0, 0, checkpoint)[:2])
        per_pair = sum(group.times(1.0, 0, checkpoint)[:2]) - base
        per_token = (sum(group.times(0.0, span, checkpoint)[:2]) - base) / span
        fixed[g] = base
        per_seq[g] = per_pair * lens * lens + per_token * lens
    return RoundProblem(tuple(int(lengths[s]) for s in seqs), cost.world_size, tuple(sizes), fixed, per_seq, caps)


def blast(lengths: Sequence[int], num_rounds: int) -> list[list[int]]:
    """Sequences into ``num_rounds`` rounds, longest first into the round with the fewest tokens."""
    rounds: list[list[int]] = [[] for _ in range(num_rounds)]
    tokens = np.zeros(num_rounds)
    for s in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = int(np.argmin(tokens))
        rounds[r].append(s)
        tokens[r] += lengths[s]
    return [r for r in rounds if r]


def least_rounds(lengths: Sequence[int], cost: FlatCost, checkpoint: int, sizes: Sequence[int]) -> int:
    """Fewest rounds whose tokens the GPUs could hold at best (each at its best tokens per GPU)."""
    per_gpu = max(cost.group(ATTENTION, g).max_tokens(checkpoint, cost.room_bytes) / g for g in sizes)
    if per_gpu <= 0:
        return 0
    return max(1, math.ceil(sum(lengths) / (per_gpu * cost.world_size)))


def build_flexsp(lengths: Sequence[int], cost: FlatCost, checkpoint: int, num_rounds: int,
                 sizes: Sequence[int], solver: str = "greedy", milp_time_limit_s: float = 1.0) -> RoundPlan:
    """A FlexSP plan with ``num_rounds`` rounds at ``checkpoint`` layers; ``ValueError`` if a round fails."""
    rounds = []
    methods = []
    for seqs in blast(lengths, num_rounds):
        prob = round_problem(lengths, seqs, cost, checkpoint, sizes)
        groups = greedy_groups(prob)
        method = "greedy"
        if solver == "milp":
            exact = milp_groups(prob, MILP_BUCKETS, milp_time_limit_s)
            if exact is not None and _valid(prob, exact) and (groups is None or prob.makespan(exact) < prob.makespan(groups)):
                groups, method = exact, "milp"
        if groups is None:
            raise ValueError(f"{NAME}: a round of {len(seqs)} sequences ({sum(prob.lengths)} tokens) does not fit "
                             f"{cost.world_size} GPUs with {checkpoint} layers checkpointed")
        methods.append(method)
        rounds.append([GroupRun(g, tuple(seqs[i] for i in members)) for g, members in groups])
    knobs = {"num_rounds": len(rounds), "solver": solver,
             "group_sizes": [sorted((g.gpus for g in r), reverse=True) for r in rounds]}
    if solver == "milp":
        knobs["milp_rounds"] = methods.count("milp")
    return RoundPlan(NAME, cost.world_size, list(lengths), ATTENTION, rounds, checkpoint, knobs)


def _valid(prob: RoundProblem, groups) -> bool:
    try:
        prob.check(groups)
    except AssertionError:
        return False
    return True


def checkpoint_grid(cost: FlatCost, fixed: int | None) -> list[int]:
    layers = cost.spec.num_layers
    if fixed is not None:
        return [fixed]
    return sorted({round(layers * q) for q in (0.0, 0.25, 0.5, 0.75, 1.0)})


def plan_flexsp(lengths: Sequence[int], cost: FlatCost, *, checkpointing: str | int = "adaptive",
                solver: str = "greedy", milp_time_limit_s: float = 1.0,
                sp_degrees: Sequence[int] | None = None) -> AlternativeResult:
    """The fastest FlexSP plan of one batch over round counts and checkpoint counts."""
    t0 = time.perf_counter()
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is not known; use one of {', '.join(SOLVERS)}")
    lengths = [int(n) for n in lengths]
    fixed = resolve_checkpointing(checkpointing, cost.spec.num_layers)
    allowed = cost.group_sizes(ATTENTION)
    sizes = sorted(set(sp_degrees)) if sp_degrees else allowed
    bad = [g for g in sizes if g not in allowed]
    if bad:
        raise ValueError(f"SP group size {bad[0]} is not possible here; use sizes among {allowed}")
    best, tried, last_error = None, [], None
    floor = cost.states.communication_floor_s()
    # Most checkpointing first: fewest rounds, so the bound below prunes the lean settings early.
    for c in sorted(checkpoint_grid(cost, fixed), reverse=True):
        low = least_rounds(lengths, cost, c, sizes)
        if low == 0:
            continue
        worse, best_here = 0, float("inf")  # the round count's search is per checkpoint count
        for m in range(low, min(low + EXTRA_ROUNDS, len(lengths)) + 1):
            if best is not None and m * floor >= best[1].step_time_s:
                break  # every round pays the ZeRO-3 collectives at least: cannot win
            try:
                plan = build_flexsp(lengths, cost, c, m, sizes, solver, milp_time_limit_s)
            except ValueError as exc:
                last_error = str(exc)
                tried.append({"checkpoint_layers": c, "num_rounds": m, "feasible": False, "error": last_error})
                continue
            sim = simulate_rounds(plan, cost)
            if solver == "milp" and plan.knobs.get("milp_rounds"):
                # The MILP minimises its bucketed model of a round; the simulation also prices the
                # ZeRO-3 collectives of the group sizes it picked, so keep the greedy plan when it
                # simulates faster (the MILP solver is then never worse than the greedy one).
                plain = build_flexsp(lengths, cost, c, m, sizes, "greedy")
                plain_sim = simulate_rounds(plain, cost)
                if plain_sim.feasible and (not sim.feasible or plain_sim.step_time_s < sim.step_time_s):
                    plan, sim = plain, plain_sim
                    plan.knobs.update(solver="milp", milp_rounds=0)
            tried.append({"checkpoint_layers": c, "num_rounds": m, "feasible": sim.feasible,
                          "step_time_s": sim.step_time_s})
            if not sim.feasible:
                last_error = sim.error
                continue
            if best is None or sim.step_time_s < best[1].step_time_s:
                best = (plan, sim)
            if sim.step_time_s < best_here:
                best_here, worse = sim.step_time_s, 0
            else:
                worse += 1
                if worse >= 2:
                    break  # more rounds only add ZeRO-3 collectives once the groups are balanced
    elapsed = time.perf_counter() - t0
    if best is None:
        error = longest_fit_hint(NAME, lengths, cost, ATTENTION, sizes)(last_error)
        return AlternativeResult(NAME, None, None, False, error, elapsed, tried, cost.world_size)
    return AlternativeResult(NAME, best[0], best[1], True, None, elapsed, tried, cost.world_size)
