"""Send release points: a send is released only after its peer consumed it, in every timing.

The check is independent of the proof in ``runtime/parallel/send_release.py``: random action durations
drive an event-driven run of the whole pipeline (an action starts when its stage is free and its
input has arrived), and every release must come after the consuming action started on the peer.
"""
import random

import pytest

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.actions import build_pipeline_actions, one_f_one_b_warmup
from infinipipe_hf.planner.search.api import PlanOptions
from infinipipe_hf.runtime.parallel.send_release import send_release_points


def _run(stages: list[list[Action]], rng: random.Random) -> list[dict[Action, float]]:
    """Start time of every action on every stage, dependency-driven with random durations."""
    pp = len(stages)
    start: list[dict[Action, float]] = [{} for _ in range(pp)]
    end: list[dict[Action, float]] = [{} for _ in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    while any(pos[s] < len(stages[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if pos[s] >= len(stages[s]):
                continue
            a = stages[s][pos[s]]
            src = s - 1 if a.is_forward else s + 1
            if 0 <= src < pp:
                if a not in end[src]:
                    continue
                ready = end[src][a] + rng.uniform(0, 0.5)  # the transfer
            else:
                ready = 0.0
            start[s][a] = max(free[s], ready)
            end[s][a] = free[s] = start[s][a] + rng.uniform(0.1, 3.0)
            pos[s] += 1
            progressed = True
        assert progressed, "schedule deadlocks"
    return start


def _check(stages: list[list[Action]], seeds=range(20), release_points=send_release_points) -> int:
    pp = len(stages)
    released = 0
    for seed in seeds:
        start = _run(stages, random.Random(seed))
        for s in range(pp):
            release = release_points(stages[s], stages[s - 1] if s else None,
                                          is_last_stage=s == pp - 1, is_first_stage=s == 0)
            for i, keys in release.items():
                at = start[s][stages[s][i]]
                for kind, unit in keys:
                    sent_at = start[s][Action(kind, unit)]
                    peer, consumer = (s + 1, Action("F", unit)) if kind == "F" else (s - 1, Action("B", unit))
                    assert sent_at < at, f"stage {s}: release of {kind}{unit} before it was sent"
                    assert start[peer][consumer] < at, (
                        f"stage {s} releases {kind}{unit} at {stages[s][i]} (t={at:.2f}) before stage "
                        f"{peer} consumed it at {consumer} (t={start[peer][consumer]:.2f}), seed {seed}")
                    released += 1
    return released


@pytest.mark.parametrize("pp,units", [(2, 3), (4, 8), (4, 17)])
def test_one_f_one_b_releases_come_after_the_peer_consumed_every_send(pp, units):
    order = list(range(units))
    stages = build_pipeline_actions(order, order, one_f_one_b_warmup(ParallelDims(pp)))
    assert _check(stages) > 0


def test_gpipe_and_reordered_backwards_release_safely():
    order = list(range(6))
    gpipe = build_pipeline_actions(order, order, [6, 6, 6])
    assert _check(gpipe) > 0
    # Slices of one sequence run backward last slice first: backward order differs from forward.
    stages = build_pipeline_actions(order, [2, 1, 0, 5, 4, 3], one_f_one_b_warmup(ParallelDims(3)))
    assert _check(stages) > 0


def test_every_output_send_is_released_at_its_backward_and_middle_stages_release_gradients():
    order = list(range(8))
    stages = build_pipeline_actions(order, order, one_f_one_b_warmup(ParallelDims(4)))
    mid = send_release_points(stages[1], stages[0], is_last_stage=False, is_first_stage=False)
    keys = [k for ks in mid.values() for k in ks]
    assert sorted(u for k, u in keys if k == "F") == order  # every output, at its unit's backward
    for i, ks in mid.items():
        for kind, unit in ks:
            if kind == "F":
                assert stages[1][i] == Action("B", unit)
    # Gradients are proven by a later forward of the previous stage: all but the last few units.
    grads = sorted(u for k, u in keys if k == "B")
    assert grads and grads == order[:len(grads)] and len(grads) >= len(order) - 4
    last = send_release_points(stages[3], stages[2], is_last_stage=True, is_first_stage=False)
    assert all(k == "B" for ks in last.values() for k, _ in ks)
    first = send_release_points(stages[0], None, is_last_stage=False, is_first_stage=True)
    assert all(k == "F" for ks in first.values() for k, _ in ks)


def test_an_unsafe_release_is_caught_by_the_timing_check():
    """The check can fail: releasing each output one action before its backward is unsafe."""
    def early(own, previous, *, is_last_stage, is_first_stage):
        out = {}
        if not is_last_stage:
            for i, a in enumerate(own):
                if not a.is_forward and i > 0:
                    out.setdefault(i - 1, []).append(("F", a.unit))
        return out

    order = list(range(8))
    stages = build_pipeline_actions(order, order, one_f_one_b_warmup(ParallelDims(4)))
    with pytest.raises(AssertionError, match="before stage"):
        _check(stages, release_points=early)


@pytest.mark.parametrize("schedule", ["epp", "seq1f1b", "packed-1f1b"])
def test_planned_schedules_release_safely(schedule):
    """Plans the planner makes (several pipelines, slices run backward last first, packs)."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.models.model_configs import config_path
    from infinipipe_hf.planner.search.api import plan_step

    spec = ModelSpec.from_json_file(config_path("llama2-7b"))
    lengths = [16384, 12000, 9000, 4000, 2500, 1200, 800, 600, 300, 200, 100]
    res = plan_step(lengths, spec, ParallelDims(pp_degree=4), PlanOptions(schedule=schedule, memory_budget_bytes=80 * 2**30))
    assert res.feasible
    stages = [res.plan.stage_actions(0, s) for s in range(4)]
    assert _check(stages, seeds=range(5)) > 0
