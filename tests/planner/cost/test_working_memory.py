"""Phase model of working memory (planner/cost/working.py): a hand-computed unit, the bound the
solver uses, and the memory timeline applying the exact phases wherever it is evaluated."""
from __future__ import annotations

import dataclasses
import random

import pytest

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.checkpointing.points import memory_points, point_bytes, stage_peak_bytes
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.search.api import PlanOptions
from infinipipe_hf.planner.simulate.simulator import simulate

SPEC = ModelSpec(model_type="llama", num_layers=4, hidden_size=512, intermediate_size=1408,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1000,
                 tie_word_embeddings=False)
WORKING = {"backward": 3000.0, "forward_full": 5000.0, "forward_mlp": 4000.0, "forward_mlp_act": 2000.0}


def _cost(working=WORKING, **kw):
    p = dataclasses.replace(default_profile(), reference={**default_profile().reference}, bytes_per_element=2,
                            working_bytes_per_token=dict(working), attention_mask_bytes_per_element=0.0)
    return CostModel(SPEC, p, ParallelDims(pp_degree=2), layers_per_stage=[2, 2], memory_budget_bytes=1e12, **kw)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="working_bytes_per_token"):
        dataclasses.replace(default_profile(), working_bytes_per_token={"backward": 1.0})
    with pytest.raises(ValueError, match="working_bytes_per_token"):
        dataclasses.replace(default_profile(), working_bytes_per_token={**WORKING, "backward": -1.0})
    assert CostModel(SPEC, default_profile(), ParallelDims(pp_degree=2)).working is None


def test_a_unit_by_hand():
    """Stage 0 (2 layers, not last), 100 tokens, no context: layer 0 checkpointed whole, layer 1 kept.

    Per token: A activation bytes, h hidden bytes, F/G as given.  Kept: layer 0 its input (h),
    layer 1 everything (A).  Forward peak: max(h + F_full, h + A + lw); backward: layer 1's phase
    (h + A + G), then layer 0's (h + (A - h) + G = A + G).  Plus 2h + 2 head_dim (in, out, rotary)."""
    cost = _cost()
    w = cost.working
    a, h, lw = cost.acts.act_bytes_per_token, cost.acts.hidden_bytes_per_token, cost.acts.layer_working_bytes_per_token
    ratio = cost.acts.act_ratio
    f_full, g = WORKING["forward_full"] * ratio, WORKING["backward"] * ratio
    extra = 2 * h + 2 * SPEC.head_dim * 2
    segs = (Segment(0, 0, 100),)
    mix = CheckpointMix(full=1)
    kept = h + a
    assert w.excess(0, segs, mix, backward=False) == pytest.approx(100 * (max(h + f_full, h + a + lw) - kept + extra))
    assert w.excess(0, segs, mix, backward=True) == pytest.approx(100 * (max(h + a + g, a + g) - kept + extra))


@pytest.mark.parametrize("seed", range(5))
def test_bound_is_never_below_the_exact_phases(seed):
    rng = random.Random(seed)
    cost = _cost(loss_chunk_tokens=rng.choice([64, 4096]))
    for _ in range(40):
        stage = rng.randint(0, 1)
        start = rng.choice([0, 0, 128, 900])
        segs = (Segment(0, start, start + rng.randint(1, 600)),) + tuple(
            Segment(i, 0, rng.randint(1, 200)) for i in range(1, rng.randint(1, 3)))
        full = rng.randint(0, 2)
        finer = {"mlp": rng.randint(0, 2 - full)}
        finer["mlp_act"] = rng.randint(0, 2 - full - finer["mlp"])
        mix = CheckpointMix.of(full, finer)
        tokens = sum(s.end - s.start for s in segs)
        ctx = cost.acts.context_bytes_per_layer(segs)
        for backward in (False, True):
            assert cost.working.excess(stage, segs, mix, backward) <= cost.working.bound(stage, tokens, ctx, backward) + 1e-6


@pytest.mark.parametrize("schedule", ["epp", "gpipe"])
def test_timeline_applies_the_phases_everywhere(schedule):
    """Array timeline, point list and peak agree bit for bit, and equal the definition: base with
    the bound swapped for the unit's exact phases, plus live activations."""
    from infinipipe_hf.planner.search.api import plan_step

    rng = random.Random(3)
    lengths = [rng.choice([40, 90, 300, 700, 1500]) for _ in range(12)]
    cost = _cost()
    plan = plan_step(lengths, SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule=schedule, max_tokens_per_unit=512 if schedule == "epp" else None, checkpointing="none"), cost=cost).plan
    for s in range(2):
        ck = {u.id: rng.randint(0, 2) for u in plan.units}
        levels = {u.id: {"mlp_act": 2 - ck[u.id]} for u in plan.units if ck[u.id] < 2 and rng.random() < 0.5}
        tl = stage_timeline(plan, cost, 0, s)
        got = tl.point_values(cost, s, ck, levels).tolist()
        pts = memory_points(plan, cost, 0, s)
        assert [point_bytes(p, plan, cost, s, ck, levels) for p in pts] == pytest.approx(got, rel=1e-12)
        assert stage_peak_bytes(plan, cost, 0, s, ck, checkpoint_levels=levels, points=pts) == pytest.approx(max(got))
        assert stage_peak_bytes(plan, cost, 0, s, ck, checkpoint_levels=levels) == max(got)
        by_id = plan.unit_by_id
        for p, value in zip(pts, got):
            u = by_id[p.running_unit]
            mix = CheckpointMix.of(ck.get(u.id, 0), levels.get(u.id))
            ctx = cost.acts.context_bytes_per_layer(u.segments)
            exact = cost.working.excess(s, u.segments, mix, not p.forward)
            bound = cost.working.bound(s, u.num_tokens, ctx, not p.forward)
            assert value == pytest.approx(point_bytes(p, plan, cost, s, ck, levels))
            assert exact <= bound + 1e-6
        # The base keeps the bound (the solver's linear constraints); the exact phases only lower it.
        assert (tl.working_corrections(cost, s, ck, levels) <= 1e-6).all()
    # The simulator reports the exact phases: its peaks are the timeline's maxima.
    sim = simulate(plan, cost)
    for s in range(2):
        assert sim.peak_memory_bytes[s] == stage_peak_bytes(plan, cost, 0, s)


def test_pipeline_buffers_by_hand():
    """Stage 0 of pp 2 (sends outputs, receives gradients): F0 F1 B0 B1 with 100 / 50 tokens."""
    import numpy as np

    cost = _cost()
    h = cost.acts.hidden_bytes_per_token
    fwd = np.array([True, True, False, False])
    tokens = np.array([100, 50, 100, 50])
    got = cost.working.pipeline_buffers(0, fwd, tokens)
    # Receives posted ahead: gradients of B0 and B1 (the two actions after F1; one after B0).
    ahead = [100 * h, 150 * h, 50 * h, 0]
    # Outputs held: F0's from F1 on through B0; F1's from B0 through B1.
    held = [0, 100 * h, 150 * h, 50 * h]
    assert got.tolist() == pytest.approx([a + b for a, b in zip(ahead, held)])
    # The last stage receives hidden states for forwards and keeps no outputs.
    assert cost.working.pipeline_buffers(1, fwd, tokens).tolist() == pytest.approx([50 * h, 0, 0, 0])
