"""The planner's device-memory model under the host tier against what the runtime keeps on the
device, on CPU, float64 (the cost model priced at 8 bytes per element).

Measured: while a unit's forward runs on a stage, an outer ``saved_tensors_hooks`` records every
distinct storage autograd saves (parameters excluded).  The ``offload`` and ``offload_attn``
layers' own hooks sit inside it (``offload_attn`` also puts its kept attention output in the
tier), so what they route into the ``HostTier`` never reaches the outer hook: what is counted is
what stays in device tensors.  Beside it, the KV store's device bytes (``KVStore.bytes()``) at
each forward's end and at each backward's start, and, with ``offload_kv``, the K/V copies the store
holds on the device at once: those handed back (alive, tracked per copy) and those asked ahead
(``prefetch``: a device copy on CUDA, a no-op on the CPU, counted as CUDA holds it).  The profile
is priced as the CPU runs: float64 (HF's RMSNorm keeps a float32 copy, half an element) on the SDPA
fallback (float masks, per-segment outputs beside their concatenation).

Predicted: each unit's activation bytes in the planner's memory timeline (``stage_timeline``),
which are ``cost.levels.unit_activation_bytes`` of the unit's ``CheckpointMix`` (an ``offload``
layer keeps nothing on the device; a unit in ``mlp_tile_tokens`` keeps no MLP intermediate in its
kept layers), the KV store's ``cost.acts.kv_bytes`` (K/V at a forward's end, K/V and pending
gradients once later slices ran backward) and, for a stage in ``offload_kv``,
``cost.host.kv_device_share`` of it.
"""
import copy
import dataclasses
import warnings
import weakref

import pytest
import torch

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.partition import partition_layers
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.cost.activations import _act_elements
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile, reference_spec
from infinipipe_hf.runtime.stage.local import _run_replica
from infinipipe_hf.runtime.stage.module import build_stage
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.reference import random_batch, tiny_model

LAYERS, HIDDEN, S = 4, 128, 128  # S: tokens per slice
TOLERANCE = 0.05


def _key(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class DeviceProbe:
    """Per (stage, unit): device bytes saved by the forward and the KV store's device bytes."""

    def __init__(self, runners):
        self.saved, self.kv_forward, self.kv_backward, self.kv_copies_peak = {}, {}, {}, {}
        for r in runners:
            self._wrap(r)

    def _wrap(self, r):
        s, fwd, bwd = r.stage.stage_index, r.forward, r.backward
        params = {_key(p) for p in r.stage.parameters()}

        def forward(uid, x):
            seen = {}

            def pack(t):
                if _key(t) not in params:
                    seen[_key(t)] = _key(t)[1]
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fwd(uid, x)
            self.saved[s, uid], self.kv_forward[s, uid] = sum(seen.values()), r.kv_store.bytes()
            return out

        def backward(uid, g):
            self.kv_backward[s, uid] = r.kv_store.bytes()
            return bwd(uid, g)
        r.forward, r.backward = forward, backward
        self._count_kv_copies(r, s)

    def _count_kv_copies(self, r, s):
        """K/V the offloaded store holds on the device: copies handed back (alive) and copies asked
        ahead (``prefetch``: on CUDA a device copy from then until read or released; on the CPU a
        no-op, counted here as CUDA would hold it)."""
        tier, alive, ahead = r.kv_store.host_tier, [0], {}
        get, prefetch, release = tier.get, tier.prefetch, tier.release
        phase = self.kv_copies_peak[s] = {"forward": 0, "backward": 0}

        def note(n):
            alive[0] += n
            now = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            phase[now] = max(phase[now], alive[0])

        def is_kv(h):
            return isinstance(h.tag, tuple) and h.tag[0] == "kv"

        def counted_prefetch(h):
            if is_kv(h) and not h.released and id(h) not in ahead:
                ahead[id(h)] = h.nbytes
                note(h.nbytes)
            prefetch(h)

        def counted_get(h, keep=False):
            out = get(h, keep)
            if is_kv(h):
                n = out.numel() * out.element_size()
                note(n - ahead.pop(id(h), 0))
                weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - n))
            return out

        def counted_release(h):
            alive[0] -= ahead.pop(id(h), 0)
            release(h)
        tier.get, tier.prefetch, tier.release = counted_get, counted_prefetch, counted_release


def run(plan, lengths, seed=50):
    model = tiny_model("llama", num_layers=LAYERS, seed=seed, hidden=HIDDEN, heads=8, kv_heads=4)
    batch = random_batch(lengths, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stages = [build_stage(copy.deepcopy(model), i, r) for i, r in enumerate(partition_layers(LAYERS, plan.pp_degree))]
    runners = [StageRunner(st, loss_chunk_tokens=64) for st in stages]
    for r in runners:
        r.begin_step(plan, batch, label_token_count(batch))
        r.kv_store.offload = r.stage.stage_index in plan.offload_kv
    probe = DeviceProbe(runners)
    _run_replica(runners, plan, 0)
    for r in runners:
        assert r.kv_store.host_tier.current_bytes == 0
        r.end_step()
    return probe, _cost(model, plan)


def _cost(model, plan) -> CostModel:
    """The shipped profile priced in float64: 8 bytes per element, the formula's float64 per-token
    bytes of the reference layer (what profiling it would measure), and the SDPA fallback's float64
    masks and per-segment outputs (the CPU's attention backend)."""
    ref = reference_spec(default_profile())
    profile = dataclasses.replace(default_profile(), bytes_per_element=8, attention_mask_bytes_per_element=8,
                                  attention_segment_outputs_kept=True,
                                  activation_bytes_per_token_per_layer=_act_elements(ref, 8) * 8.0)
    return CostModel(ModelSpec.from_hf_config(model.config), profile, ParallelDims(pp_degree=plan.pp_degree),
                     layers_per_stage=plan.layers_per_stage, host_budget_bytes=2.0**40, loss_chunk_tokens=64)


def sliced_plan(pp, mixes, offload_kv=()):
    """Sequence 0 in three slices (the last packed with sequence 1), sequence 2 whole; per stage
    all forwards then all backwards (slices last first); ``mixes[(stage + unit) % len]``."""
    lengths = [3 * S, 40, 96]
    units = [Unit(0, (Segment(0, 0, S),)), Unit(1, (Segment(0, S, 2 * S),)),
             Unit(2, (Segment(0, 2 * S, 3 * S), Segment(1, 0, 40))), Unit(3, (Segment(2, 0, 96),))]
    acts = [F(u) for u in range(4)] + [B(u) for u in (3, 2, 1, 0)]
    plan = Plan("test", pp, 1, lengths, units, {0: [list(acts) for _ in range(pp)]}, {},
                layers_per_stage=[len(x) for x in partition_layers(LAYERS, pp)])
    for s in range(pp):
        for u in units:
            m = mixes[(s + u.id) % len(mixes)]
            plan.checkpoint_layers.setdefault(s, {})[u.id] = m.full
            if m.finer:
                plan.checkpoint_levels.setdefault(s, {})[u.id] = m.finer
    plan.offload_kv = list(offload_kv)
    return plan, lengths


def predicted(cost, plan, stage) -> dict[int, float]:
    """The planner's activation bytes of each unit on ``stage`` (its memory timeline's)."""
    tl = stage_timeline(plan, cost, 0, stage)
    got = tl.activations(cost, stage, plan.checkpoint_layers.get(stage, {}), plan.checkpoint_levels.get(stage, {}))
    return dict(zip(tl.units.tolist(), got.tolist()))


def check_activations(probe, cost, plan):
    """Every (stage, unit): measured device bytes saved within ``TOLERANCE`` of the model."""
    ratios = {}
    for (s, uid), got in sorted(probe.saved.items()):
        unit, m = plan.unit_by_id[uid], plan.checkpoint_mix(s, uid)
        want = predicted(cost, plan, s)[uid]
        tiled = uid in plan.mlp_tile_tokens
        assert want == pytest.approx(cost.levels.unit_activation_bytes(s, unit.segments, m, tiled), rel=1e-12)
        print(f"stage {s} unit {uid} {m}{' tiled' if tiled else ''}: device {got} B, model {want:.0f} B")
        if want:
            ratios[s, uid] = got / want
        else:  # every layer offloaded, not the last stage: only the token ids stay (embedding)
            one_input = cost.host.layer_offload_bytes(s, unit.segments)
            assert got <= TOLERANCE * one_input, (s, uid, got, one_input)
    print("ratios", {k: round(r, 4) for k, r in ratios.items()})
    bad = {k: r for k, r in ratios.items() if abs(r - 1) > TOLERANCE}
    assert not bad, f"device bytes off the model by more than {TOLERANCE:.0%}: {bad}"
    return ratios


MIXES = [CheckpointMix(offload=1, full=1), CheckpointMix(offload=2), CheckpointMix(full=1, offload=1),
         CheckpointMix(), CheckpointMix(offload=1)]
ATTN_MIXES = [CheckpointMix(offload_attn=1, full=1), CheckpointMix(offload_attn=2), CheckpointMix(mlp_act=1, offload_attn=1),
              CheckpointMix(), CheckpointMix(offload_attn=1, offload=1)]


PAIR_MIXES = [CheckpointMix(offload_pair=2), CheckpointMix(offload_pair=1, full=1), CheckpointMix(offload_pair=2),
              CheckpointMix(), CheckpointMix(offload_attn=1, offload_pair=1)]


@pytest.mark.parametrize("pp,mixes", [(1, MIXES), (2, MIXES), (2, ATTN_MIXES), (1, PAIR_MIXES), (2, PAIR_MIXES)])
def test_offloaded_layers_keep_what_the_model_says_on_the_device(pp, mixes):
    plan, lengths = sliced_plan(pp, mixes)
    assert any(plan.checkpoint_mix(s, u.id).replayed_whole - plan.checkpoint_mix(s, u.id).keep_attn
               - plan.checkpoint_mix(s, u.id).full for s in range(pp) for u in plan.units)
    probe, cost = run(plan, lengths)
    check_activations(probe, cost, plan)
    # The KV store on the device: exactly the slices' K/V at a forward's end; the model's K/V and
    # pending gradients once the later slices ran backward (before the first slice's backward).
    for s in range(pp):
        kv = [cost.acts.kv_bytes(s, n) for n in (S, 2 * S)]
        assert [probe.kv_forward[s, u] for u in (0, 1, 2)] == [kv[0] / 2, kv[1] / 2, kv[1] / 2]
        assert probe.kv_backward[s, 0] == kv[1]
        assert max(probe.kv_backward.values()) == max(kv)  # the model's store peak, exactly


@pytest.mark.parametrize("pp", [1, 2])
def test_offload_kv_leaves_the_device_store_empty_and_its_copies_within_the_share(pp):
    plan, lengths = sliced_plan(pp, MIXES, offload_kv=range(pp))
    probe, cost = run(plan, lengths)
    check_activations(probe, cost, plan)
    assert set(probe.kv_forward.values()) == {0} and set(probe.kv_backward.values()) == {0}
    for s in range(pp):
        share = cost.host.kv_device_share(s) * cost.acts.kv_bytes(s, 2 * S)  # the store at its fullest
        got = probe.kv_copies_peak[s]
        print(f"stage {s}: K/V copies on the device at once {got}, model's share {share:.0f} B, "
              f"ratio {max(got.values()) / share:.4f}")
        # Two layers' K/V (the running one, the next prefetched; a replay prefetches the layer
        # before it), forward and backward: exactly the share at the store's fullest.
        assert max(got.values()) == share and min(got.values()) > 0


def test_whole_sequence_tiled_unit():
    """ALST's plan in EPP's terms: each sequence one unit, its MLP in tiles, its layers offloaded,
    recomputed or kept (a kept tiled layer keeps no MLP intermediate; nor does one at ``mlp_act``)."""
    lengths = [3 * S, 100]
    units = [Unit(0, (Segment(0, 0, 3 * S),)), Unit(1, (Segment(1, 0, 100),))]
    plan = Plan("test", 1, 1, lengths, units, {0: [[F(0), B(0), F(1), B(1)]]}, {}, layers_per_stage=[LAYERS])
    for u, m in ((0, CheckpointMix(offload=1, full=1)), (1, CheckpointMix(offload=1, mlp_act=1))):
        plan.checkpoint_layers.setdefault(0, {})[u] = m.full
        plan.checkpoint_levels.setdefault(0, {})[u] = m.finer
    plan.mlp_tile_tokens = {0: 64, 1: 64}
    probe, cost = run(plan, lengths)
    check_activations(probe, cost, plan)
    untiled = dataclasses.replace(plan, mlp_tile_tokens={})
    for uid, want in predicted(cost, untiled, 0).items():  # untiled, the kept MLPs would count
        assert probe.saved[0, uid] < (1 - TOLERANCE) * want


def test_whole_sequence_tiled_attention_unit():
    """A whole sequence with its attention side in tiles (``attention_tile_tokens``), as the
    whole-unit candidate plans it (every layer offloaded or checkpointed: the timeline's bytes),
    and one with every layer kept: what such a layer keeps is the kernel's q, k, v and output and
    the layer input (``attention_tiled_bytes_per_token``), well under a whole layer."""
    lengths = [3 * S, 100]
    units = [Unit(0, (Segment(0, 0, 3 * S),)), Unit(1, (Segment(1, 0, 100),))]
    plan = Plan("test", 1, 1, lengths, units, {0: [[F(0), B(0), F(1), B(1)]]}, {}, layers_per_stage=[LAYERS])
    plan.checkpoint_layers = {0: {0: 1, 1: 0}}
    plan.checkpoint_levels = {0: {0: {"offload": LAYERS - 1}}}
    plan.mlp_tile_tokens = plan.attention_tile_tokens = {0: 64, 1: 64}
    probe, cost = run(plan, lengths)
    got = probe.saved.pop((0, 1))  # unit 1 keeps its layers: the activations' attention-tiled bytes
    want = cost.acts.unit_activation_bytes(0, units[1].segments, 0, attention_tiled=True)
    print(f"unit 1, every layer kept, attention side tiled: device {got} B, model {want:.0f} B, ratio {got / want:.4f}")
    check_activations(probe, cost, dataclasses.replace(plan, units=[units[0]], actions={0: [[F(0), B(0)]]}))
    assert abs(got / want - 1) <= TOLERANCE
    assert got < (1 - TOLERANCE) * cost.acts.unit_activation_bytes(0, units[1].segments, 0, mlp_tiled=True)
