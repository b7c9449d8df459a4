"""Knob search shared by the non-pipeline schedules: tune per batch, or run one fixed setting.

Every schedule here has a small grid of knobs (SP or CP degree, packing length, FlexSP's number of
rounds) and one uniform checkpoint count.  :func:`tune` builds a plan for each knob setting,
simulates it and keeps the fastest that fits; the checkpoint count is the least that fits the
setting's largest micro-batch (``checkpointing="adaptive"``, the default), every layer
(``"full"``), none (``"none"``), or a given count (an ``int``: a static setting that must serve a
whole run, see :mod:`.static`).

The micro-batches of equal groups run in *lockstep rounds* (ZeRO-3 gathers every layer over all
GPUs, so every group runs the same number of micro-batches): :func:`lockstep_rounds` sorts them by
time and deals them out ``groups`` at a time, which minimises the sum of the rounds' maxima for a
given set of micro-batches (the slowest ``groups`` share a round, and so on).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import (AlternativeResult, GroupRun, RoundPlan,
    simulate_rounds)

CHECKPOINTING = ("adaptive", "none", "full")


def resolve_checkpointing(checkpointing: str | int, num_layers: int) -> int | None:
    """``None`` (least that fits) or a fixed count, with a clear error for bad values."""
    if isinstance(checkpointing, str):
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={checkpointing!r} is not known; use adaptive, none, full or a "
                             f"layer count 0..{num_layers}")
        return {"adaptive": None, "none": 0, "full": num_layers}[checkpointing]
    if isinstance(checkpointing, bool) or int(checkpointing) != checkpointing or not 0 <= checkpointing <= num_layers:
        raise ValueError(f"checkpointing={checkpointing!r}: a fixed count must be an integer in 0..{num_layers} "
                         f"(the model's decoder layers)")
    return int(checkpointing)


def lockstep_rounds(times: Sequence[float], groups: int) -> list[list[int]]:
    """Indices of micro-batches per round: slowest first, ``groups`` per round."""
    order = sorted(range(len(times)), key=lambda i: (-times[i], i))
    return [order[i:i + groups] for i in range(0, len(order), groups)]


def equal_group_plan(schedule: str, lengths: Sequence[int], cost: FlatCost, attention: str, size: int,
                     micro_batches: list[list[int]], checkpoint: int | None, knobs: dict) -> RoundPlan:
    """Micro-batches (lists of sequence ids) on equal groups of ``size`` GPUs in lockstep rounds.

    ``checkpoint=None`` picks the least uniform count that fits the largest micro-batch; raises
    ``ValueError`` when none does.
    """
    group = cost.group(attention, size)
    padded = [group.padded_tokens(sum(lengths[s] for s in mb)) for mb in micro_batches]
    if checkpoint is None:
        checkpoint = group.least_checkpoint(max(padded), cost.room_bytes)
        if checkpoint is None:
            raise ValueError(no_fit_message(schedule, cost, group.size, max(padded), knobs))
    times = [sum(group.times(group.micro_batch_pairs([lengths[s] for s in mb], p), p, 0)[:2])
             for mb, p in zip(micro_batches, padded)]
    rounds = [[GroupRun(size, tuple(micro_batches[i])) for i in idx]
              for idx in lockstep_rounds(times, cost.world_size // size)]
    return RoundPlan(schedule, cost.world_size, list(lengths), attention, rounds, checkpoint, dict(knobs))


def no_fit_message(schedule: str, cost: FlatCost, gpus: int, tokens: int, knobs: dict) -> str:
    room = cost.room_bytes / 2**30
    return (f"{schedule} with {knobs}: a micro-batch of {tokens} tokens on {gpus} GPU(s) does not fit "
            f"{cost.memory_budget_bytes / 2**30:.1f} GiB per GPU even with every layer checkpointed "
            f"({room:.1f} GiB left beside the ZeRO-3 states)")


def tune(schedule: str, lengths: Sequence[int], cost: FlatCost, grid: Iterable[dict],
         build: Callable[[dict, int | None], RoundPlan], checkpointing: str | int = "adaptive",
         infeasible: Callable[[str | None], str] | None = None) -> AlternativeResult:
    """The fastest plan over ``grid`` (knob dicts), each built by ``build(knobs, checkpoint)``."""
    t0 = time.perf_counter()
    fixed = resolve_checkpointing(checkpointing, cost.spec.num_layers)
    best = None
    tried: list[dict] = []
    last_error = None
    for knobs in grid:
        try:
            plan = build(knobs, fixed)
        except ValueError as exc:
            last_error = str(exc)
            tried.append({**knobs, "feasible": False, "error": last_error})
            continue
        sim = simulate_rounds(plan, cost)
        tried.append({**knobs, "checkpoint_layers": plan.checkpoint_layers, "feasible": sim.feasible,
                      "step_time_s": sim.step_time_s})
        if not sim.feasible:
            last_error = sim.error
        elif best is None or sim.step_time_s < best[1].step_time_s:
            best = (plan, sim)
    elapsed = time.perf_counter() - t0
    if best is None:
        error = infeasible(last_error) if infeasible else (last_error or f"{schedule}: no knob setting to try")
        return AlternativeResult(schedule, None, None, False, error, elapsed, tried, cost.world_size)
    return AlternativeResult(schedule, best[0], best[1], True, None, elapsed, tried, cost.world_size)


def longest_fit_hint(schedule: str, lengths: Sequence[int], cost: FlatCost, attention: str,
                     sizes: Sequence[int]) -> Callable[[str | None], str]:
    """An infeasibility message naming the longest sequence and the largest group tried."""
    def message(last_error: str | None) -> str:
        longest = max(lengths)
        seq = list(lengths).index(longest)
        top = max(sizes)
        group = cost.group(attention, top)
        cap = group.max_tokens(cost.spec.num_layers, cost.room_bytes)
        if cost.room_bytes <= 0:
            return (f"{schedule}: the ZeRO-3 model states alone need {cost.states.static_bytes / 2**30:.1f} GiB "
                    f"per GPU, over the {cost.memory_budget_bytes / 2**30:.1f} GiB budget; use more GPUs or a "
                    f"larger memory budget")
        if longest > cap:
            return (f"{schedule}: sequence {seq} of {longest} tokens does not fit {cost.memory_budget_bytes / 2**30:.1f} "
                    f"GiB per GPU even on {top} GPUs with every layer checkpointed (at most {cap} tokens fit); "
                    f"truncate longer documents, use more GPUs or a schedule that slices sequences (epp)")
        return f"{schedule}: no knob setting fits this batch; last candidate said: {last_error}"
    return message


def check_sizes(name: str, asked: Sequence[int] | None, allowed: Sequence[int]) -> list[int]:
    """``asked`` group sizes (all of ``allowed`` when None), each checked against ``allowed``."""
    if not asked:
        return list(allowed)
    bad = [g for g in asked if g not in allowed]
    if bad:
        raise ValueError(f"{name}={bad[0]!r} is not possible here; use one of {', '.join(map(str, allowed))} "
                         f"(powers of two dividing the world size; Ulysses also at most the model's heads)")
    return sorted(set(int(g) for g in asked))
