"""Memory points of a stage (planner/checkpointing/points.py, live_windows.py, timeline.py) against
hand-computed values on 1F1B plans."""
from __future__ import annotations

import random

import pytest

from infinipipe_hf.ir.actions import parse_actions
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.live_windows import live_windows, timeline_windows
from infinipipe_hf.planner.checkpointing.points import MemoryPoint, memory_points, point_bytes, stage_peak_bytes
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.search.api import PlanOptions

SPEC = ModelSpec(model_type="llama", num_layers=4, hidden_size=512, intermediate_size=1408,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1000,
                 tie_word_embeddings=False)


def make_plan(lengths, units, stage_actions, pp=2):
    return Plan(schedule="epp", pp_degree=pp, dp_degree=1, sequences=list(lengths), units=units,
                actions={0: [parse_actions(s) for s in stage_actions]}, checkpoint_layers={})


@pytest.fixture
def cost():
    return CostModel(SPEC, dims=ParallelDims(pp_degree=2), layers_per_stage=[2, 2], memory_budget_bytes=1e12)


@pytest.fixture
def plan():
    # Sequence 0 (300 tokens) in two slices, then a packed unit of sequences 1 and 2.
    units = [Unit(0, (Segment(0, 0, 200),)), Unit(1, (Segment(0, 200, 300),)),
             Unit(2, (Segment(1, 0, 100), Segment(2, 0, 50)))]
    # EPP warm-up: stage 0 runs (pp-1-0)+(2-1) = 2 forwards first, stage 1 runs 1; backward of the
    # sliced sequence goes last slice first.
    return make_plan([300, 100, 50], units, ["F0 F1 F2 B1 B0 B2", "F0 F1 B1 F2 B0 B2"])


def test_points_match_hand_computation(plan, cost):
    s = 0
    st = cost.acts.static_bytes(s)
    kv = cost.acts.kv_bytes(s, 200)  # only unit 0's segment continues (200 < 300)
    wf = lambda t: cost.acts.working_bytes(s, t, 0, backward=False)
    wb = lambda t: cost.acts.working_bytes(s, t, 1, backward=True)
    # The second slice's layers read its 200 tokens of context: two copies while one runs.
    read = 2 * 200 * cost.acts.kv_bytes_per_token_per_layer
    assert cost.acts.context_read_bytes(plan.units[1].segments) == read
    expected = [
        (0, st + kv + wf(200), (0,)),
        (1, st + kv + wf(100) + read, (0, 1)),
        (2, st + kv + wf(150), (0, 1, 2)),
        (3, st + kv + wb(100) + read, (0, 1, 2)),
        (4, st + kv + wb(200), (0, 2)),  # KV still held while the first slice runs backward
        (5, st + wb(150), (2,)),  # ... and freed after it
    ]
    got = memory_points(plan, cost, 0, s)
    assert [(p.action_index, p.live_units) for p in got] == [(i, live) for i, _, live in expected]
    for p, (_, base, _) in zip(got, expected):
        assert p.base_bytes == pytest.approx(base, rel=1e-12)


def test_last_stage_points(plan, cost):
    s = 1
    got = memory_points(plan, cost, 0, s)
    assert [p.live_units for p in got] == [(0,), (0, 1), (0, 1), (0, 2), (0, 2), (2,)]
    kv = cost.acts.kv_bytes(s, 200)
    assert got[3].base_bytes == pytest.approx(cost.acts.static_bytes(s) + kv + cost.acts.working_bytes(s, 150, 0, False))
    assert got[5].base_bytes == pytest.approx(cost.acts.static_bytes(s) + cost.acts.working_bytes(s, 150, 1, True))


def test_kv_store_lifetime_three_slices(cost):
    # Slices 0 and 1 of sequence 0 continue; both stay until slice 0's backward is done.
    units = [Unit(0, (Segment(0, 0, 100),)), Unit(1, (Segment(0, 100, 180),)),
             Unit(2, (Segment(0, 180, 240),)), Unit(3, (Segment(1, 0, 64),))]
    plan = make_plan([240, 64], units, ["F0 F1 F2 F3 B2 B1 B0 B3", "F0 F1 F2 B2 F3 B1 B0 B3"])
    s = 0
    kv0, kv1 = cost.acts.kv_bytes(s, 100), cost.acts.kv_bytes(s, 80)
    got = memory_points(plan, cost, 0, s)
    kv_of = [p.base_bytes - cost.acts.static_bytes(s) for p in got]
    read = [cost.acts.context_read_bytes(u.segments) for u in units]  # slices 1 and 2 read 100, 180 tokens
    assert read[1] == 2 * 100 * cost.acts.kv_bytes_per_token_per_layer and read[0] == read[3] == 0
    work = [cost.acts.working_bytes(s, t, 0, False) + r for t, r in zip((100, 80, 60, 64), read)]
    work += [cost.acts.working_bytes(s, t, 1, True) + read[u] for u, t in zip((2, 1, 0, 3), (60, 80, 100, 64))]
    kv_expected = [kv0, kv0 + kv1, kv0 + kv1, kv0 + kv1, kv0 + kv1, kv0 + kv1, kv0 + kv1, 0.0]
    assert kv_of == pytest.approx([k + w for k, w in zip(kv_expected, work)])
    assert [p.live_units for p in got] == [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (0, 1, 2, 3),
                                           (0, 1, 3), (0, 3), (3,)]


def test_point_bytes_linear_in_counts_and_exact_with_nothing_checkpointed(plan, cost):
    p = memory_points(plan, cost, 0, 0)[3]
    assert not p.forward  # a backward: its base counts a layer the running unit rebuilds
    b0 = point_bytes(p, plan, cost, 0, {})
    b1 = point_bytes(p, plan, cost, 0, {0: 1})
    b2 = point_bytes(p, plan, cost, 0, {0: 2, 2: 1})
    slope0 = cost.acts.activation_bytes_per_checkpointed_layer(0, 200)
    slope2 = cost.acts.activation_bytes_per_checkpointed_layer(0, 150)
    assert b1 - b2 == pytest.approx(slope0 + slope2)
    # With nothing checkpointed on the stage no unit rebuilds a layer: the point drops the one its base counts.
    rebuilt = cost.acts.rebuilt_bound_bytes(0, plan.unit_by_id[p.running_unit].num_tokens)
    assert rebuilt == pytest.approx(cost.acts.activation_bytes(0, plan.unit_by_id[p.running_unit].num_tokens, 0)
                                    / cost.layers_per_stage[0])
    assert b0 - b1 == pytest.approx(slope0 - rebuilt)
    # Unit 1 (tokens 200..300 of sequence 0) also keeps, per layer, a copy of its 200-token context K/V.
    context = 2 * 200 * cost.acts.kv_bytes_per_token_per_layer
    assert b0 == pytest.approx(p.base_bytes - rebuilt + context
                               + sum(cost.acts.activation_bytes(0, t, 0) for t in (200, 100, 150)))


def test_stage_peak_is_max_of_points(plan, cost):
    rng = random.Random(0)
    for _ in range(20):
        ck = {u: rng.randint(0, 2) for u in range(3)}
        for s in range(2):
            pts = memory_points(plan, cost, 0, s)
            want = max(point_bytes(p, plan, cost, s, ck) for p in pts)
            assert stage_peak_bytes(plan, cost, 0, s, ck) == pytest.approx(want, rel=1e-12)


def test_stage_peak_defaults_to_plan_counts(plan, cost):
    plan.checkpoint_layers = {0: {0: 2, 1: 2, 2: 2}}
    assert stage_peak_bytes(plan, cost, 0, 0) == pytest.approx(
        stage_peak_bytes(plan, cost, 0, 0, {0: 2, 1: 2, 2: 2}))
    assert stage_peak_bytes(plan, cost, 0, 0) < stage_peak_bytes(plan, cost, 0, 0, {})


def _random_1f1b(rng, n_units, pp, stage):
    warm = min(n_units, pp - 1 - stage + rng.randint(0, 2))
    order = list(range(n_units))
    back = order[:]
    rng.shuffle(back)  # any backward order: windows must not assume FIFO
    acts = [f"F{u}" for u in order[:warm]]
    fi, bi = warm, 0
    while bi < n_units:
        if fi < n_units:
            acts.append(f"F{order[fi]}")
            fi += 1
        # Only backward units already forwarded.
        done = {int(a[1:]) for a in acts if a[0] == "F"}
        if back[bi] in done:
            acts.append(f"B{back[bi]}")
            bi += 1
        elif fi >= n_units:
            raise AssertionError("unreachable: all forwarded")
    return " ".join(acts)


def test_live_windows_equal_subset_relation(cost):
    rng = random.Random(1)
    for trial in range(30):
        n = rng.randint(1, 9)
        units = [Unit(u, (Segment(u, 0, 10 + u),)) for u in range(n)]
        stages = [_random_1f1b(rng, n, 2, s) for s in range(2)]
        plan = make_plan([10 + u for u in range(n)], units, stages)
        for s in range(2):
            pts = memory_points(plan, cost, 0, s)
            firsts, lasts = live_windows(pts, plan.stage_actions(0, s))
            for i, pi in enumerate(pts):
                contains = [j for j, pj in enumerate(pts) if set(pi.live_units) <= set(pj.live_units)]
                assert contains == list(range(firsts[i], lasts[i] + 1)), (stages[s], i)


def test_unknown_unit_and_stage_errors(plan, cost):
    with pytest.raises(ValueError, match="stage 5"):
        memory_points(plan, cost, 0, 5)
    with pytest.raises(ValueError, match="dp_rank 3"):
        memory_points(plan, cost, 3, 0)
    bad = make_plan([300, 100, 50], plan.units, ["F0 F7 B7 B0", "F0 B0"])
    with pytest.raises(ValueError, match="unit 7"):
        memory_points(bad, cost, 0, 0)


def test_memory_point_is_plain_data():
    p = MemoryPoint(3, 1.5, (1, 2))
    assert p == MemoryPoint(3, 1.5, (1, 2)) and hash(p) == hash(MemoryPoint(3, 1.5, (1, 2)))


def test_live_windows_reject_broken_windows(cost):
    units = [Unit(0, (Segment(0, 0, 10),)), Unit(1, (Segment(1, 0, 10),))]
    for text in ("B0 F0 F1 B1", "F0 F0 B0 F1 B1", "F0 B0 F1 B1 B0"):
        plan = make_plan([10, 10], units, [text, "F0 B0 F1 B1"])
        pts = memory_points(plan, cost, 0, 0)
        with pytest.raises(ValueError, match="unit 0"):
            live_windows(pts, plan.stage_actions(0, 0))


def _reference_point_bytes(plan, cost, stage, actions, ck):
    """Straight-from-the-definition bytes of every point (module docstring of planner/checkpointing/memory_walk.py)."""
    by_id = plan.unit_by_id
    fpos = {a.unit: i for i, a in enumerate(actions) if a.is_forward}
    bpos = {a.unit: i for i, a in enumerate(actions) if not a.is_forward}
    out = []
    for i, a in enumerate(actions):
        total = cost.acts.static_bytes(stage)
        u = by_id[a.unit]
        # A backward's bound rebuilds a layer, unless the stage checkpoints nothing (then exact).
        rebuilds = 0 if a.is_forward or not any(ck.values()) else 1
        total += cost.acts.working_bytes(stage, u.num_tokens, rebuilds, backward=not a.is_forward)
        total += cost.acts.context_read_bytes(u.segments)
        layers = cost.layers_per_stage[stage]
        for v, f in fpos.items():  # live activations, plus each layer's copy of the slice's context K/V
            if f <= i <= bpos[v]:
                total += cost.acts.activation_bytes(stage, by_id[v].num_tokens, ck.get(v, 0))
                context = sum(seg.start for seg in by_id[v].segments)
                total += (layers - ck.get(v, 0)) * context * 2 * SPEC.kv_dim * cost.profile.bytes_per_element
        for v, f in fpos.items():  # K/V of continuing segments until the first slice's backward ends
            if f > i:
                continue
            for seg in by_id[v].segments:
                if seg.end < plan.sequences[seg.seq]:
                    first = next(w for w in fpos if any(s.seq == seg.seq and s.start == 0
                                                        for s in by_id[w].segments))
                    if bpos[first] >= i:
                        total += cost.acts.kv_bytes(stage, seg.end - seg.start)
        out.append(total)
    return out


@pytest.mark.parametrize("schedule", ["epp", "seq1f1b", "gpipe"])
def test_array_timeline_equals_definition_on_planned_steps(schedule):
    from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
    from infinipipe_hf.planner.search.api import plan_step

    rng = random.Random(7)
    lengths = [rng.choice([40, 90, 300, 700, 1500, 3000]) for _ in range(14)]
    res = plan_step(lengths, SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule=schedule, max_tokens_per_unit=512 if schedule != "gpipe" else None, checkpointing="none"))
    plan = res.plan
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=2), layers_per_stage=[2, 2], memory_budget_bytes=1e12)
    for s in range(2):
        actions = plan.stage_actions(0, s)
        ck = {u.id: rng.randint(0, 2) for u in plan.units}
        tl = stage_timeline(plan, cost, 0, s)
        assert tl.regular
        want = _reference_point_bytes(plan, cost, s, actions, ck)
        got = tl.point_values(cost, s, ck)
        assert got.tolist() == pytest.approx(want, rel=1e-12)
        pts = memory_points(plan, cost, 0, s)
        assert [point_bytes(p, plan, cost, s, ck) for p in pts] == pytest.approx(want, rel=1e-12)
        assert stage_peak_bytes(plan, cost, 0, s, ck) == pytest.approx(max(want), rel=1e-12)
        firsts, lasts = timeline_windows(tl)
        assert (firsts.tolist(), lasts.tolist()) == tuple(map(list, live_windows(pts, actions)))


def test_unit_facts_memo_keys_what_the_facts_depend_on():
    """A cost model memoizes each unit's facts per stage; a unit with the same segments in a batch
    where they are no longer continued, or tiled otherwise, gets its own facts, so a warm memo
    walks every plan to the same memory as a fresh cost model does."""
    from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
    from tests.planner.hand_plans import epp_plan

    def fresh():
        return CostModel(SPEC, dims=ParallelDims(pp_degree=2), layers_per_stage=[2, 2], memory_budget_bytes=1e12)

    warm = fresh()
    # The same slices (0-2048, 2048-4096 of sequence 0) continue in the first batch, not the second.
    plans = [epp_plan([6144, 1024, 512], 2, 2048, 2048), epp_plan([4096, 1024, 512], 2, 2048, 2048)]
    for tile in ("mlp_tile_tokens", "attention_tile_tokens"):
        plans.append(epp_plan([4096, 1024, 512], 2, 2048, 2048))
        setattr(plans[-1], tile, {u.id: 256 for u in plans[-1].units})
    for plan in plans:
        for stage in (0, 1):
            got, want = stage_timeline(plan, warm, 0, stage), stage_timeline(plan, fresh(), 0, stage)
            assert got.base.tolist() == want.base.tolist()
            assert got.context_bytes == want.context_bytes
    assert len(warm.unit_memo) > 0
