"""Processor-sharing replay (ranks sharing a few cores): hand-computed cases, the dedicated limit,
and the simulator using it when the profile sets ``shared_cores``."""
import dataclasses
import random

import pytest

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.schedules.pipeline import build_pipeline_actions, one_f_one_b_warmup
from infinipipe_hf.planner.simulate.replay import replay
from infinipipe_hf.planner.simulate.shared_replay import shared_replay
from infinipipe_hf.planner.simulate.simulator import simulate


def acts(text: str) -> list[Action]:
    return [Action(a[0], int(a[1:])) for a in text.split()]


def work(stage, a):
    return 1.0 if a.is_forward else 2.0


def no_transfer(a):
    return 0.0


def spans(rep):
    """Per stage, ``[start, end, start, end, ...]`` of its actions."""
    return [[t for pair in zip(s, e) for t in pair] for s, e in zip(rep.start, rep.end)]


def flat(pairs):
    return pytest.approx([t for pair in pairs for t in pair])


def test_one_f_one_b_on_one_core_by_hand():
    """pp 2, two units, F = 1 s and B = 2 s of work, both ranks on one core.

    t 0-1 stage 0 F0 alone; 1-3 F1 (s0) and F0 (s1) share the core; 3-5 s1 B0 alone (s0 waits
    for it); 5-7 s0 B0 and s1 F1 share (F1 done, B0 half done); 7-9 s0 B0 and s1 B1 share (B0
    done); 9-10 s1 B1 alone; 10-12 s0 B1.  One core never idles: the step is all the work, 12 s."""
    stages = [acts("F0 F1 B0 B1"), acts("F0 B0 F1 B1")]
    (rep,) = shared_replay([stages], work, no_transfer, cores=1)
    assert rep.complete
    assert spans(rep)[0] == flat([(0, 1), (1, 3), (5, 9), (10, 12)])
    assert spans(rep)[1] == flat([(1, 3), (3, 5), (5, 7), (7, 10)])
    # The same plan with a core per rank is the textbook 1F1B: (m + p - 1) * (F + B) = 9 s.
    (own,) = shared_replay([stages], work, no_transfer, cores=2)
    assert max(own.end[0][-1], own.end[1][-1]) == pytest.approx(9.0)


def test_replicas_share_the_cores_and_transfers_use_none():
    """Two one-stage replicas on one core run at half speed; a transfer delays without using a core."""
    reps = shared_replay([[acts("F0 B0")], [acts("F1 B1")]], work, no_transfer, cores=1)
    for rep in reps:
        assert spans(rep)[0] == flat([(0, 2), (2, 6)])
    (rep,) = shared_replay([[acts("F0 B0"), acts("F0 B0")]], work, lambda a: 0.5, cores=1)
    assert spans(rep) == [flat([(0, 1), (5, 7)]), flat([(1.5, 2.5), (2.5, 4.5)])]


def test_sp_ranks_count_as_busy_ranks():
    """A stage of 2 SP ranks loads 2 cores: sp 2 on 2 cores is the single-rank stage on 1 core."""
    stages = [acts("F0 F1 B0 B1"), acts("F0 B0 F1 B1")]
    (a,) = shared_replay([stages], work, no_transfer, cores=2, ranks_per_stage=2)
    (b,) = shared_replay([stages], work, no_transfer, cores=1)
    assert spans(a) == [pytest.approx(x) for x in spans(b)]


def _random_1f1b(rng, p, m):
    ids = list(range(m))
    return build_pipeline_actions(ids, ids, p, one_f_one_b_warmup(p))


@pytest.mark.parametrize("seed", range(6))
def test_enough_cores_is_the_dedicated_replay(seed):
    rng = random.Random(seed)
    p, m = rng.choice([2, 3, 4]), rng.randint(1, 7)
    stages = _random_1f1b(rng, p, m)
    durations = {(s, str(a)): rng.uniform(0.1, 3.0) for s in range(p) for a in stages[s]}

    def dur(s, a):
        return durations[(s, str(a))]

    def tr(a):
        return 0.01 * (a.unit + 1)

    want = replay(stages, dur, tr)
    # A core per rank, shared freely or with every rank pinned to its own: the dedicated replay.
    for pinned in (False, True):
        (got,) = shared_replay([stages], dur, tr, cores=p, pinned=pinned)
        for s in range(p):
            assert got.start[s] == pytest.approx(want.start[s]) and got.end[s] == pytest.approx(want.end[s])
    # Fewer cores never speed a plan up, and one core runs exactly the total work.
    (one,) = shared_replay([stages], dur, tr, cores=1)
    assert max(e[-1] for e in one.end) >= max(e[-1] for e in want.end) - 1e-9
    assert max(e[-1] for e in one.end) >= sum(durations.values()) - 1e-9


def test_deadlock_is_reported_as_incomplete():
    (rep,) = shared_replay([[acts("B0 F0"), acts("F0 B0")]], work, no_transfer, cores=1)
    assert not rep.complete and rep.done == [0, 0]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="cores must be > 0"):
        shared_replay([[acts("F0 B0")]], work, no_transfer, cores=0)
    with pytest.raises(ValueError, match="ranks_per_stage"):
        shared_replay([[acts("F0 B0")]], work, no_transfer, cores=1, ranks_per_stage=0)
    with pytest.raises(ValueError, match="shared_cores"):
        dataclasses.replace(default_profile(), shared_cores=-1)


def test_simulator_uses_shared_cores_from_the_profile():
    spec = ModelSpec("llama", 4, 256, 688, 8, 4, 32, 2048, False)
    units = [Unit(i, (Segment(i, 0, 256),)) for i in range(4)]
    ids = [u.id for u in units]
    plan = Plan("packed-1f1b", 4, 1, [256] * 4, units,
                {0: build_pipeline_actions(ids, ids, 4, one_f_one_b_warmup(4))}, {}, [1, 1, 1, 1])
    base = dataclasses.replace(default_profile(), p2p_latency_s=0.0)  # compute-bound: stages overlap
    own = simulate(plan, CostModel(spec, base, pp_degree=4, layers_per_stage=[1] * 4))
    two = simulate(plan, CostModel(spec, dataclasses.replace(base, shared_cores=2), pp_degree=4,
                                   layers_per_stage=[1] * 4))
    four = simulate(plan, CostModel(spec, dataclasses.replace(base, shared_cores=4), pp_degree=4,
                                    layers_per_stage=[1] * 4))
    assert four.step_time_s == pytest.approx(own.step_time_s)
    assert two.step_time_s > own.step_time_s * 1.05
    # Serialisation keeps the field.
    assert HardwareProfile.from_dict(dataclasses.replace(base, shared_cores=2).to_dict()).shared_cores == 2


def test_pinned_ranks_share_only_their_own_core():
    """Four one-stage replicas (global ranks 0-3) pinned round-robin on 2 cores: ranks 0 and 2 on
    core 0, 1 and 3 on core 1.  With work on ranks 0 and 2 only, pinned they halve each other's
    speed (core 1 idles); shared freely they would each get a core."""
    reps = [[acts("F0 B0")], [[]], [acts("F2 B2")], [[]]]
    pinned = shared_replay(reps, work, no_transfer, cores=2, pinned=True)
    free = shared_replay(reps, work, no_transfer, cores=2)
    for r in (0, 2):
        assert spans(pinned[r])[0] == flat([(0, 2), (2, 6)])
        assert spans(free[r])[0] == flat([(0, 1), (1, 3)])
    # Work on ranks 0 and 1 (different cores): pinned is the free sharing.
    reps = [[acts("F0 B0")], [acts("F1 B1")], [[]], [[]]]
    for a, b in zip(shared_replay(reps, work, no_transfer, cores=2, pinned=True),
                    shared_replay(reps, work, no_transfer, cores=2)):
        assert spans(a) == [pytest.approx(x) for x in spans(b)]


def test_pinned_sp_stage_advances_at_its_slowest_rank():
    """pp 2 x sp 2 pinned on 2 cores: stage s's SP ranks are global ranks 2s and 2s+1, on cores 0
    and 1, so both stages have a rank on each core; and pp 1 x sp 2 on one core shares it."""
    stages = [acts("F0 F1 B0 B1"), acts("F0 B0 F1 B1")]
    (a,) = shared_replay([stages], work, no_transfer, cores=2, ranks_per_stage=2, pinned=True)
    (b,) = shared_replay([stages], work, no_transfer, cores=1)
    assert spans(a) == [pytest.approx(x) for x in spans(b)]
    (c,) = shared_replay([[acts("F0 B0")]], work, no_transfer, cores=1, ranks_per_stage=2, pinned=True)
    assert spans(c)[0] == flat([(0, 2), (2, 6)])


def test_pinned_needs_whole_cores():
    with pytest.raises(ValueError, match="whole number of cores"):
        shared_replay([[acts("F0 B0")]], work, no_transfer, cores=1.5, pinned=True)
    with pytest.raises(ValueError, match="pinned_ranks needs shared_cores"):
        dataclasses.replace(default_profile(), pinned_ranks=True)
    assert HardwareProfile.from_dict(dataclasses.replace(default_profile(), shared_cores=2, pinned_ranks=True)
                                     .to_dict()).pinned_ranks is True


def _chain_plan(pp):
    spec = ModelSpec("llama", pp, 256, 688, 8, 4, 32, 2048, False)
    units = [Unit(0, (Segment(0, 0, 256),))]
    plan = Plan("packed-1f1b", pp, 1, [256], units, {0: build_pipeline_actions([0], [0], pp, one_f_one_b_warmup(pp))},
                {}, [1] * pp)
    return spec, plan


@pytest.mark.parametrize("pp", [2, 3])
def test_message_cpu_is_charged_to_both_ends_on_shared_cores(pp):
    """One unit through a pp-stage chain sends 2 (pp - 1) messages (hidden states forward,
    gradients back); on shared cores each costs its CPU once, half on each end, on the critical
    path here; on devices of their own (GPUs) the transport takes no compute."""
    spec, plan = _chain_plan(pp)
    base = dataclasses.replace(default_profile(), shared_cores=pp)
    msg = dataclasses.replace(base, p2p_cpu_s=1e-3, p2p_cpu_s_per_byte=1e-9)
    cost = CostModel(spec, msg, pp_degree=pp, layers_per_stage=[1] * pp)
    per_message = 1e-3 + 256 * cost.hidden_bytes_per_token * 1e-9
    assert cost.message_cpu_time(256) == pytest.approx(per_message)
    without = simulate(plan, CostModel(spec, base, pp_degree=pp, layers_per_stage=[1] * pp)).step_time_s
    assert simulate(plan, cost).step_time_s == pytest.approx(without + 2 * (pp - 1) * per_message)
    gpu = dataclasses.replace(msg, shared_cores=0)
    assert simulate(plan, CostModel(spec, gpu, pp_degree=pp, layers_per_stage=[1] * pp)).step_time_s == \
        pytest.approx(simulate(plan, CostModel(spec, dataclasses.replace(gpu, p2p_cpu_s=0, p2p_cpu_s_per_byte=0),
                                               pp_degree=pp, layers_per_stage=[1] * pp)).step_time_s)
