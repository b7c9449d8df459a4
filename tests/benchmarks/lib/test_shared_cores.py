"""Ranks sharing a few cores (benchmarks/lib/shared_cores.py): the processor-sharing replay on
hand-computed cases and its dedicated limit, the simulator using it through ``SharedCoresCost``,
the planner pricing with it, and the benchmark profile files that carry the setting."""
import dataclasses
import json
import random
import types

import pytest

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.shared_cores import (
    KEYS,
    SharedCores,
    SharedCoresCost,
    device_profile,
    engine_planner,
    engine_profile,
    load_profile,
    profile_dict,
    save_profile,
    shared_replay,
    split_profile,
    with_shared_cores,
)
from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.pipeline.actions import build_pipeline_actions, one_f_one_b_warmup
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.simulate.replay import replay
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
    return build_pipeline_actions(ids, ids, one_f_one_b_warmup(ParallelDims(p)))


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
        SharedCores(-1)


def _four_stage_plan():
    spec = ModelSpec("llama", 4, 256, 688, 8, 4, 32, 2048, False)
    units = [Unit(i, (Segment(i, 0, 256),)) for i in range(4)]
    ids = [u.id for u in units]
    plan = Plan("packed-1f1b", 4, 1, [256] * 4, units,
                {0: build_pipeline_actions(ids, ids, one_f_one_b_warmup(ParallelDims(4)))}, {}, [1, 1, 1, 1])
    return spec, plan


def test_simulator_uses_shared_cores_from_the_cost_model(tmp_path):
    spec, plan = _four_stage_plan()
    base = dataclasses.replace(default_profile(), p2p_latency_s=0.0)  # compute-bound: stages overlap
    dims = ParallelDims(pp_degree=4)
    own = simulate(plan, CostModel(spec, base, dims, layers_per_stage=[1] * 4))
    two = simulate(plan, SharedCoresCost(spec, base, dims, layers_per_stage=[1] * 4, shared=SharedCores(2)))
    four = simulate(plan, SharedCoresCost(spec, base, dims, layers_per_stage=[1] * 4, shared=SharedCores(4)))
    assert four.step_time_s == pytest.approx(own.step_time_s)
    assert two.step_time_s > own.step_time_s * 1.05
    # Serialisation keeps the setting (beside the profile's fields, in the benchmark's files).
    assert split_profile(profile_dict(base, SharedCores(2)))[1].cores == 2
    save_profile(tmp_path / "p.json", base, SharedCores(2))
    assert load_profile(tmp_path / "p.json") == (base, SharedCores(2))


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
        split_profile({**default_profile().to_dict(), "pinned_ranks": True})
    with pytest.raises(ValueError, match="pinned_ranks needs shared_cores"):
        SharedCores(1.5, pinned=True)
    assert split_profile(profile_dict(default_profile(), SharedCores(2, pinned=True)))[1].pinned is True


def _chain_plan(pp):
    spec = ModelSpec("llama", pp, 256, 688, 8, 4, 32, 2048, False)
    units = [Unit(0, (Segment(0, 0, 256),))]
    plan = Plan("packed-1f1b", pp, 1, [256], units, {0: build_pipeline_actions([0], [0], one_f_one_b_warmup(ParallelDims(pp)))},
                {}, [1] * pp)
    return spec, plan


@pytest.mark.parametrize("pp", [2, 3])
def test_message_cpu_is_charged_to_both_ends_on_shared_cores(pp):
    """One unit through a pp-stage chain sends 2 (pp - 1) messages (hidden states forward,
    gradients back); on shared cores each costs its CPU once, half on each end, on the critical
    path here; on devices of their own (GPUs) the transport takes no compute."""
    spec, plan = _chain_plan(pp)
    base, dims, shared = default_profile(), ParallelDims(pp_degree=pp), SharedCores(pp)
    msg = dataclasses.replace(base, p2p_cpu_s=1e-3, p2p_cpu_s_per_byte=1e-9)
    cost = SharedCoresCost(spec, msg, dims, layers_per_stage=[1] * pp, shared=shared)
    per_message = 1e-3 + 256 * cost.acts.hidden_bytes_per_token * 1e-9
    assert cost.compute.message_cpu_time(256) == pytest.approx(per_message)
    without = simulate(plan, SharedCoresCost(spec, base, dims, layers_per_stage=[1] * pp, shared=shared)).step_time_s
    assert simulate(plan, cost).step_time_s == pytest.approx(without + 2 * (pp - 1) * per_message)
    gpu = msg  # no shared cores: a plain CostModel
    assert simulate(plan, CostModel(spec, gpu, dims, layers_per_stage=[1] * pp)).step_time_s == \
        pytest.approx(simulate(plan, CostModel(spec, dataclasses.replace(gpu, p2p_cpu_s=0, p2p_cpu_s_per_byte=0), dims, layers_per_stage=[1] * pp)).step_time_s)


def test_shared_cost_keeps_the_context_and_plan_step_prices_with_it():
    """``SharedCoresCost.of`` is the same stage context on shared cores (sub-group costs stay
    plain); ``plan_step(cost=...)`` simulates its plans with it, so the plans it picks are priced
    on the shared cores, not on a device per rank."""
    spec = ModelSpec("llama", 4, 256, 688, 8, 4, 32, 2048, False)
    compute_bound = dataclasses.replace(default_profile(), p2p_latency_s=0.0)
    plain = CostModel(spec, compute_bound, ParallelDims(pp_degree=4), memory_budget_bytes=2**30)
    shared = SharedCoresCost.of(plain, SharedCores(1))
    assert shared.ctx is plain.ctx and shared.shared == SharedCores(1)
    assert shared.for_group(1) is shared and with_shared_cores(plain, None) is plain
    sp2 = SharedCoresCost.of(CostModel(spec, default_profile(), ParallelDims(pp_degree=2, sp_degree=2)), SharedCores(2))
    assert type(sp2.for_group(1)) is CostModel  # a sub-group prices single actions: no sharing there
    batch = [700, 300, 200, 90, 64] * 4
    res, own = (plan_step(batch, spec, None, PlanOptions(), cost=c) for c in (shared, plain))
    assert res.simulation.step_time_s == simulate(res.plan, shared).step_time_s
    assert own.simulation.step_time_s == simulate(own.plan, plain).step_time_s
    # 4 stages on 1 core: the many units that fill a pipeline of devices (about 2x slower there)
    # lose to the planner's pick for the shared core.
    assert len(res.plan.units) < len(own.plan.units)
    assert simulate(own.plan, shared).step_time_s > 1.5 * own.simulation.step_time_s
    assert simulate(own.plan, shared).step_time_s > res.simulation.step_time_s


def test_committed_benchmark_profiles_load_with_their_setting():
    for path in sorted(RESULTS.glob("*.profile.json")):
        profile, shared = load_profile(path)
        assert isinstance(profile, HardwareProfile), path
        keys = json.loads(path.read_text()).keys() & set(KEYS)
        assert (shared is not None) == bool(keys and json.loads(path.read_text())["shared_cores"]), path
    assert load_profile(RESULTS / "sim_vs_real.profile.json")[1] == SharedCores(2.0, pinned=True)
    assert load_profile(RESULTS / "sim_vs_real_unpinned.profile.json")[1] == SharedCores(2.0, pinned=False)
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(RESULTS / "missing.profile.json")


def test_engine_profile_strips_the_setting_for_the_engine(tmp_path):
    plain, shared = engine_profile(str(RESULTS / "ab_runtime.profile.json"), tmp_path)
    assert shared == SharedCores(2.0, pinned=True) and plain.startswith(str(tmp_path))
    assert HardwareProfile.load(plain) == load_profile(RESULTS / "ab_runtime.profile.json")[0]
    assert not json.loads(open(plain).read()).keys() & set(KEYS)
    save_profile(tmp_path / "gpu.json", default_profile(), None)  # keys present, no sharing
    assert engine_profile(str(tmp_path / "gpu.json"), tmp_path)[1] is None
    default_profile().save(tmp_path / "bare.json")  # no keys: the file itself
    assert engine_profile(str(tmp_path / "bare.json"), tmp_path) == (str(tmp_path / "bare.json"), None)
    assert engine_profile(None, tmp_path) == (None, None)
    assert device_profile(tmp_path / "gpu.json") == default_profile()
    with pytest.raises(ValueError, match="share 2 cores"):
        device_profile(RESULTS / "ab_runtime.profile.json")


def test_engine_planner_prices_the_engines_own_request_on_shared_cores():
    spec = ModelSpec("llama", 4, 256, 688, 8, 4, 32, 2048, False)
    dims = ParallelDims(pp_degree=2)
    options = PlanOptions(schedule="epp", memory_budget_bytes=2**30, layers_per_stage=[2, 2], loss_chunk_tokens=1024)
    request = {"spec": spec, "dims": dims, "options": options}
    engine = types.SimpleNamespace(default_planner=types.SimpleNamespace(request=lambda e: request))
    assert engine_planner(None) is None
    res = engine_planner(SharedCores(1))([700, 300, 200, 90, 64], engine)
    want = plan_step([700, 300, 200, 90, 64], spec, dims, options,
                     cost=SharedCoresCost.of(options.cost(spec, dims), SharedCores(1)))
    assert res.plan.to_dict() == want.plan.to_dict()
    assert res.simulation.step_time_s == want.simulation.step_time_s
    assert res.simulation.step_time_s > simulate(res.plan, options.cost(spec, dims)).step_time_s


def test_a_reused_profile_keeps_its_cores_and_takes_the_pinning_asked():
    """``sim_vs_real --profile FILE [--no-pin]``: the file's cores, pinned or not as asked; pinning
    a profile that names no cores is refused."""
    from benchmarks.cpu.cpu_profile import load_or_fit

    path = str(RESULTS / "sim_vs_real.profile.json")
    for pinned in (True, False):
        profile, shared, report = load_or_fit(path, None, quick=True, pinned=pinned, max_load=100, max_wait_s=0)
        assert (profile, shared) == (load_profile(path)[0], SharedCores(2.0, pinned)) and report["reused_profile"] == path
    bare = str(RESULTS / "runtime_cpu_bench.profile.json")  # a profile file without the setting
    assert load_or_fit(bare, None, quick=True, pinned=False, max_load=100, max_wait_s=0)[1] is None
    with pytest.raises(ValueError, match="needs the cores they share"):
        load_or_fit(bare, None, quick=True, pinned=True, max_load=100, max_wait_s=0)
