"""A FlexSP plan of one batch at a given checkpoint count and number of rounds.

The batch is blasted into rounds (:func:`~infinipipe_hf.planner.batch.rounds.blast`); each
round's GPUs are split into SP groups and its sequences assigned to them by the solvers of
:mod:`.flexsp_solver`, on the affine round model of :func:`round_problem`.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.flexsp_solver import milp_groups
from infinipipe_hf.planner.alternatives.round_plan import GroupRun, RoundPlan
from infinipipe_hf.planner.batch.group_packing import RoundProblem, greedy_groups
from infinipipe_hf.planner.batch.rounds import blast

NAME = "flexsp"
ATTENTION = "ulysses"
MILP_BUCKETS = 16
"""Length buckets of the MILP (FlexSP buckets sequences to keep the MILP small)."""


def round_problem(lengths: Sequence[int], seqs: Sequence[int], cost: FlatCost, checkpoint: int,
                  sizes: Sequence[int]) -> RoundProblem:
    """The solver's view of one round: per size the affine time split and the token cap.

    A group's time is affine in its attention pairs, and in its tokens once every GPU of the group
    holds whole tokens (the SP cost splits ``ceil(tokens / size)`` per GPU).  So the token slope is
    the secant from no tokens to the group's token cap: exact at both ends and in between up to
    rounding (the slope at the ceil's first-token corner would make large groups look nearly free).
    """
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
    """Checkpoint counts searched: ``fixed``, or every layer's share in quarters."""
    layers = cost.spec.num_layers
    if fixed is not None:
        return [fixed]
    return sorted({round(layers * q) for q in (0.0, 0.25, 0.5, 0.75, 1.0)})
