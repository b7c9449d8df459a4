"""The plan of a non-pipeline step as plain data, and its simulation.

A :class:`RoundPlan` is a list of *rounds*; a round is the groups of GPUs that run one micro-batch
each at the same time (:class:`GroupRun`: how many GPUs, which whole sequences).  DeepSpeed-
Ulysses and ring CP use equal groups in every round; FlexSP changes the groups every round.  The
plan is what ``--emit-plan`` writes for these schedules (``RoundPlan.to_dict``)::

    {"schedule", "world_size", "attention": "ulysses" | "ring" | "ring-packed", "sequences": [lengths],
     "checkpoint_layers": c, "knobs": {...},
     "rounds": [[{"gpus": g, "sequences": [seq ids]}, ...], ...]}

:func:`simulate_rounds` prices it with :class:`~.flat_cost.FlatCost`: each group's forward and
backward per GPU, a round as long as its slowest group plus the ZeRO-3 collectives it cannot hide,
the step as the sum of its rounds; peak memory per GPU is the states plus the largest micro-batch's
activations; ``recompute_time_s`` sums over groups, as the pipeline's sums over stages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost


@dataclass(frozen=True)
class GroupRun:
    """One group's micro-batch in one round."""

    gpus: int
    """GPUs in the group (its SP or CP degree)."""
    seqs: tuple[int, ...]
    """Whole sequences it processes, packed (ring CP: exactly one)."""


@dataclass
class RoundPlan:
    """One step of a non-pipeline schedule (module docstring)."""

    schedule: str
    world_size: int
    sequences: list[int]
    attention: str
    """``ulysses`` (all-to-all SP), ``ring`` (ring-attention CP) or ``ring-packed`` (its THD variant)."""
    rounds: list[list[GroupRun]]
    checkpoint_layers: int
    """Decoder layers checkpointed uniformly in every micro-batch."""
    knobs: dict[str, Any] = field(default_factory=dict)
    """The knob values this plan was built with (sp size, packing length, rounds...)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.sequences)

    @property
    def num_micro_batches(self) -> int:
        return sum(len(r) for r in self.rounds)

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "world_size": self.world_size, "attention": self.attention,
                "sequences": list(self.sequences), "checkpoint_layers": self.checkpoint_layers,
                "knobs": dict(self.knobs),
                "rounds": [[{"gpus": g.gpus, "sequences": list(g.seqs)} for g in rnd] for rnd in self.rounds]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass
class RoundSimulation:
    """Step time and memory of a :class:`RoundPlan` (per GPU)."""

    step_time_s: float
    tokens_per_s: float
    bubble_fraction: float
    """Share of GPU-time not spent computing (waiting for a slower group, exposed collectives)."""
    peak_memory_bytes: float
    memory_budget_bytes: float
    recompute_time_s: float
    padded_tokens: int
    """Tokens computed including padding."""
    round_times_s: list[float]
    feasible: bool
    error: str | None = None


def check_plan(plan: RoundPlan) -> None:
    """Every sequence exactly once; every round's groups fit the world."""
    seen: list[int] = []
    for i, rnd in enumerate(plan.rounds):
        gpus = sum(g.gpus for g in rnd)
        if gpus > plan.world_size:
            raise ValueError(f"round {i} uses {gpus} GPUs but the world has {plan.world_size}")
        for g in rnd:
            if not g.seqs:
                raise ValueError(f"round {i} has a group of {g.gpus} GPUs with no sequence")
            seen.extend(g.seqs)
    if sorted(seen) != list(range(len(plan.sequences))):
        raise ValueError(f"the plan covers sequences {sorted(seen)[:10]}... instead of each of the "
                         f"{len(plan.sequences)} sequences exactly once")


def simulate_rounds(plan: RoundPlan, cost: FlatCost) -> RoundSimulation:
    """Price ``plan`` (module docstring); raises ``ValueError`` on a malformed plan."""
    check_plan(plan)
    lengths = plan.sequences
    c = plan.checkpoint_layers
    step = busy = recompute = 0.0
    padded_total = 0
    peak_act = 0.0
    worst = None
    rounds = []
    for rnd in plan.rounds:
        fwd_max = bwd_max = 0.0
        for g in rnd:
            group = cost.group(plan.attention, g.gpus)
            lens = [lengths[s] for s in g.seqs]
            padded = group.padded_tokens(sum(lens))
            pairs = group.micro_batch_pairs(lens, padded)
            fwd, bwd, rec = group.times(pairs, padded, c)
            fwd_max, bwd_max = max(fwd_max, fwd), max(bwd_max, bwd)
            busy += g.gpus * (fwd + bwd)
            recompute += rec
            padded_total += padded
            act = group.activation_peak_bytes(padded, c)
            if act > peak_act:
                peak_act, worst = act, (g, padded)
        t = cost.states.round_time(fwd_max, bwd_max) + cost.states.calibration.group_round_s * sum(g.gpus > 1 for g in rnd)
        rounds.append(t)
        step += t
    peak = cost.states.static_bytes + peak_act
    budget = cost.memory_budget_bytes
    feasible = peak <= budget
    error = None
    if not feasible:
        g, padded = worst
        error = (f"{plan.schedule}: a micro-batch of {padded} tokens on {g.gpus} GPU(s) with {c} of "
                 f"{cost.spec.num_layers} layers checkpointed needs {peak / 2**30:.2f} GiB per GPU (states "
                 f"{cost.states.static_bytes / 2**30:.2f} GiB) but the budget is {budget / 2**30:.2f} GiB")
    capacity = step * plan.world_size
    return RoundSimulation(step, plan.num_tokens / step if step > 0 else 0.0,
                           max(0.0, 1.0 - busy / capacity) if capacity > 0 else 0.0, peak, budget, recompute,
                           padded_total, rounds, feasible, error)
