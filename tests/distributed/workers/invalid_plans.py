"""Invalid plans passed to ``train_step`` (any world size, one pipeline): refused before any
communication, on every rank, with the validator's grid.

Each case gives every rank the same broken plan; each rank must raise ``PlanValidationError``
within a second (no rank waits for a peer: the check is local) with the stage-by-time grid and the
failing action marked ``!``.  A valid step afterwards shows no rank was left mid-communication.
Prints ``CASE <name> OK`` per case and ``ALL OK``.
"""
from __future__ import annotations

import dataclasses
import time

from common import (
    LENGTHS,
    UNITS_DP1,
    InfiniPipeConfig,
    PipelineEngine,
    dist,
    init,
    log,
    make_plan,
    random_batch,
    tiny_model,
)

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.validate.validator import PlanValidationError


def _with_actions(plan, stage: int, edit):
    actions = {d: [list(a) for a in per] for d, per in plan.actions.items()}
    actions[0][stage] = edit(actions[0][stage])
    return dataclasses.replace(plan, actions=actions)


def _segment_past_end(plan):
    units = list(plan.units)
    u = units[-1]
    last = u.segments[-1]
    seg = Segment(last.seq, last.start, plan.sequences[last.seq] + 5)
    units[-1] = dataclasses.replace(u, segments=(*u.segments[:-1], seg))
    return dataclasses.replace(plan, units=units)


def _too_many_checkpointed(plan, layers: int):
    ck = {s: dict(per) for s, per in plan.checkpoint_layers.items()}
    ck.setdefault(0, {})[plan.units[0].id] = layers + 1
    return dataclasses.replace(plan, checkpoint_layers=ck)


def bad_plans(plan, layers_per_stage):
    last = plan.pp_degree - 1
    return {
        "reversed_actions": (_with_actions(plan, 0, lambda a: a[::-1]), "before F"),
        "dropped_B0": (_with_actions(plan, last, lambda a: [x for x in a if x != Action("B", 0)]),
                       "never runs B0"),
        "segment_past_end": (_segment_past_end(plan), "outside the batch"),
        "unknown_unit": (_with_actions(plan, 0, lambda a: a + [Action("F", 99)]),
                         "unit 99 is not a unit of the plan"),
        "checkpoints_over_layers": (_too_many_checkpointed(plan, layers_per_stage[0]),
                                    f"checkpoints {layers_per_stage[0] + 1} layers"),
    }


def refused(name: str, engine, batch, plan, fragment: str) -> None:
    t0 = time.perf_counter()
    try:
        engine.train_step(batch, plan=plan)
    except PlanValidationError as exc:
        elapsed = time.perf_counter() - t0
        text = str(exc)
        assert fragment in text, f"{name}: {text!r} lacks {fragment!r}"
        assert exc.grid and "!" in exc.grid and exc.grid in text, f"{name}: no marked grid in {text!r}"
        assert elapsed < 1.0, f"{name}: refused after {elapsed:.2f}s"
        log(f"CASE {name} OK {elapsed * 1e3:.0f} ms: {exc.problem[:100]!r}")
        return
    raise AssertionError(f"{name}: the plan ran")


if __name__ == "__main__":
    init()
    pp = dist.get_world_size()
    engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(pp_degree=pp, p2p_timeout_s=60))
    good = make_plan(LENGTHS, UNITS_DP1, pp, engine.layers_per_stage,
                     checkpoint=lambda s, u, n: u % (n + 1))
    batch = random_batch(LENGTHS)
    for name, (plan, fragment) in bad_plans(good, engine.layers_per_stage).items():
        refused(name, engine, batch, plan, fragment)
    out = engine.train_step(batch, plan=good)  # every rank is still in step with the others
    log(f"CASE valid_step_after OK loss={out.loss:.6f}")
    dist.barrier()
    log("ALL OK")
