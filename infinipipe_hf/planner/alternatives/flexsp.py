"""``flexsp``: the seed system FlexSP (Wang et al., ASPLOS 2025): per-step heterogeneous SP groups.

What it models: ZeRO-3 states over all GPUs (:class:`~.flat_cost.Zero3States`); every step, the
batch is split into micro-batches (rounds) and, for each round, the GPUs are split into Ulysses
SP groups of power-of-two sizes, possibly all different, and every sequence of the round goes to
one group, whole, packed with the group's others.  Long sequences get large groups (memory),
short ones small groups (no all-to-all), and the assignment balances the groups' times
(:mod:`.flexsp_solver`, plans built by :mod:`.flexsp_build`).

Knobs of one batch: a uniform checkpoint count (every layer's share in quarters, most first) and
the number of rounds ``M``, from the least the GPUs' memory allows upward.  Each round's groups
come from :func:`~.flexsp_solver.greedy_groups` (default) or :func:`~.flexsp_solver.milp_groups`
(FlexSP's MILP on length buckets, with a time limit; the greedy plan is kept when it simulates
faster).  A run fixes only the checkpoint count: the groups are re-solved every step by design.

Simplified against the paper: the blaster balances tokens rather than solving jointly with the
rounds; the checkpoint count is a searched knob (FlexSP fixes one per run); a round lasts as long
as its slowest group (ZeRO-3 gathers synchronise the groups layer by layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.flexsp_build import ATTENTION, NAME, build_flexsp, checkpoint_grid, least_rounds
from infinipipe_hf.planner.alternatives.round_plan import RoundPlan, RoundSimulation, simulate_rounds
from infinipipe_hf.planner.alternatives.round_schedule import RoundContext, RoundSchedule, resolve_checkpointing
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState

EXTRA_ROUNDS = 3
"""Round counts searched beyond the least that memory allows."""
SOLVERS = ("greedy", "milp")


@dataclass(frozen=True)
class FlexSPKnobs(Knobs):
    checkpoint_layers: int
    num_rounds: int

    def record(self) -> dict:
        return {"checkpoint_layers": self.checkpoint_layers, "num_rounds": self.num_rounds}


@dataclass(frozen=True)
class FlexSPContext(RoundContext):
    solver: str = "greedy"
    milp_time_limit_s: float = 1.0


class FlexSPSchedule(RoundSchedule):
    name = NAME
    attention = ATTENTION
    regroups_every_step = True

    def context(self, lengths: list[int], cost: FlatCost, checkpointing: str | int = "adaptive", *,
                solver: str = "greedy", milp_time_limit_s: float = 1.0,
                sp_degrees: Sequence[int] | None = None) -> FlexSPContext:
        """``solver``: ``greedy`` or ``milp``; ``sp_degrees`` restricts the group sizes."""
        cost = cost.for_system(self.name)
        if solver not in SOLVERS:
            raise ValueError(f"solver={solver!r} is not known; use one of {', '.join(SOLVERS)}")
        lengths = [int(n) for n in lengths]
        fixed = resolve_checkpointing(checkpointing, cost.spec.num_layers)
        allowed = cost.group_sizes(ATTENTION)
        sizes = sorted(set(sp_degrees)) if sp_degrees else allowed
        bad = [g for g in sizes if g not in allowed]
        if bad:
            raise ValueError(f"SP group size {bad[0]} is not possible here; use sizes among {allowed}")
        return FlexSPContext(lengths, cost, fixed, sizes, solver, milp_time_limit_s)

    def candidates(self, ctx: FlexSPContext, state: SearchState) -> Iterator[Candidate]:
        floor = ctx.cost.states.communication_floor_s()
        # Most checkpointing first: fewest rounds, so the bound below prunes the lean settings early.
        for c in sorted(checkpoint_grid(ctx.cost, ctx.checkpoint), reverse=True):
            low = least_rounds(ctx.lengths, ctx.cost, c, ctx.sizes)
            if low == 0:
                continue
            worse, best_here = 0, float("inf")  # the round count's search is per checkpoint count
            for m in range(low, min(low + EXTRA_ROUNDS, len(ctx.lengths)) + 1):
                if state.best is not None and m * floor >= state.best[1].step_time_s:
                    break  # every round pays the ZeRO-3 collectives at least: cannot win
                yield Candidate(FlexSPKnobs(c, m), partial(build_flexsp, ctx.lengths, ctx.cost, c, m, ctx.sizes,
                                                           ctx.solver, ctx.milp_time_limit_s))
                sim = state.last
                if sim is None or not sim.feasible:
                    continue
                if sim.step_time_s < best_here:
                    best_here, worse = sim.step_time_s, 0
                else:
                    worse += 1
                    if worse >= 2:
                        break  # more rounds only add ZeRO-3 collectives once the groups are balanced

    def refine(self, plan: RoundPlan, sim: RoundSimulation, knobs: FlexSPKnobs,
               ctx: FlexSPContext) -> tuple[RoundPlan, RoundSimulation]:
        """With the MILP, the greedy plan when it simulates faster: the MILP minimises its bucketed
        model of a round, while the simulation also prices the ZeRO-3 collectives of its groups."""
        if ctx.solver == "milp" and plan.knobs.get("milp_rounds"):
            plain = build_flexsp(ctx.lengths, ctx.cost, knobs.checkpoint_layers, knobs.num_rounds, ctx.sizes, "greedy")
            plain_sim = simulate_rounds(plain, ctx.cost)
            if plain_sim.feasible and (not sim.feasible or plain_sim.step_time_s < sim.step_time_s):
                plan, sim = plain, plain_sim
                plan.knobs.update(solver="milp", milp_rounds=0)
        return plan, sim

    def record(self, knobs: FlexSPKnobs, plan: RoundPlan, sim: RoundSimulation) -> dict:
        return {**knobs.record(), "feasible": sim.feasible, "step_time_s": sim.step_time_s}

    def static_checkpoint_counts(self, cost: FlatCost) -> list[int]:
        """Checkpoint counts a run may fix (its only static knob)."""
        return checkpoint_grid(cost, None)
