"""The ``offload`` checkpoint level and K/V offload against the unsplit HF model, float64, on CPU.

A plan puts some or all of a unit's layers at ``offload`` (alone and mixed with ``full`` and the
finer levels) over slices carrying K/V, a hybrid and packed units; loss and every gradient equal
the reference, and each stage's host tier shows the layer inputs left (one hidden state per
offloaded layer and unit) and came back (bytes in == bytes out, nothing left after the step).  K/V
offload keeps a stage's carried K/V on the host: the KV store holds no K/V on the device, the
gradients of earlier slices still arrive exactly.
"""
import pytest

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.runtime.stage.local import _run_replica
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, collect_grads, make_plan
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model

HIDDEN = 32  # tiny_config's hidden size


def run(model, plan, batch, offload_kv=(), tied=False):
    """Loss and gradients vs the reference; the runners (their KV stores and host tiers)."""
    stages = build_stages(model, plan.pp_degree)
    runners = [StageRunner(st, loss_chunk_tokens=5) for st in stages]
    n = label_token_count(batch)
    for r in runners:
        r.begin_step(plan, batch, n)
        r.kv_store.offload = r.stage.stage_index in offload_kv
    kv_seen = []
    for r in runners:  # the device bytes of the KV store, at its fullest, per stage
        put = r.kv_store.put

        def spy(*a, _put=put, _store=r.kv_store, **k):
            e = _put(*a, **k)
            kv_seen.append((_store, _store.bytes(), type(e).__name__))
            return e
        r.kv_store.put = spy
    loss = sum(_run_replica(runners, plan, d) for d in sorted(plan.actions))
    for r in runners:
        r.end_step()
    ref_loss, ref = reference_loss_and_grads(model, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    got = collect_grads(stages, tied)
    assert set(got) == set(ref)
    assert_grads_close(got, ref, rtol=1e-10)
    return runners, kv_seen


def offloaded_bytes(plan, stage, itemsize=8):
    """Host bytes the plan's offload layers put out on ``stage``: one input per layer and unit."""
    return sum(plan.checkpoint_mix(stage, u.id).offload * u.num_tokens * HIDDEN * itemsize for u in plan.units)


def with_mix(plan, mix):
    """``mix(stage, unit, layers) -> CheckpointMix`` on every (stage, unit)."""
    for s, layers in enumerate(plan.layers_per_stage):
        for u in plan.units:
            m = mix(s, u.id, layers)
            plan.checkpoint_layers.setdefault(s, {})[u.id] = m.full
            if m.finer:
                plan.checkpoint_levels.setdefault(s, {})[u.id] = m.finer
    return plan


@pytest.mark.parametrize("pp", [1, 2])
def test_every_layer_offloaded(pp):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=30)
    batch = random_batch(LENGTHS, seed=30, with_labels=True)
    plan = with_mix(make_plan(pp, "1f1b", "none"), lambda s, u, n: CheckpointMix(offload=n))
    runners, _ = run(model, plan, batch)
    for r in runners:
        check_round_trip(r.kv_store.host_tier, offloaded_bytes(plan, r.stage.stage_index))


def check_round_trip(tier, want: int) -> None:
    """The tier took ``want`` bytes out, gave them all back, and never held more at once."""
    s = tier.stats
    assert want > 0 and s.bytes_out == s.bytes_in == want, (s, want)
    assert s.current_bytes == 0 and 0 < s.peak_bytes <= want


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_offload_mixed_with_other_levels(family):
    model = tiny_model(family, num_layers=NUM_LAYERS, seed=31, tie=family == "qwen2")
    batch = random_batch(LENGTHS, seed=31)
    mixes = [CheckpointMix(offload=1, full=1), CheckpointMix(offload=1, mlp=1), CheckpointMix(offload=1),
             CheckpointMix(offload=1, keep_attn=1), CheckpointMix(full=1, mlp_act=1), CheckpointMix()]
    plan = with_mix(make_plan(2, "gpipe", "none"), lambda s, u, n: mixes[(s + u) % len(mixes)])
    assert any(plan.checkpoint_mix(s, u.id).offload for s in (0, 1) for u in plan.units)
    runners, _ = run(model, plan, batch, tied=family == "qwen2")
    for r in runners:
        s = r.kv_store.host_tier.stats
        assert s.bytes_out == s.bytes_in == offloaded_bytes(plan, r.stage.stage_index) and s.current_bytes == 0


@pytest.mark.parametrize("ckpt", ["none", "all"])
def test_kv_offload_keeps_carried_kv_on_the_host(ckpt):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=32)
    batch = random_batch(LENGTHS, seed=32, with_labels=True)
    plan = make_plan(2, "1f1b", ckpt)
    runners, kv_seen = run(model, plan, batch, offload_kv=(0, 1))
    assert kv_seen and all(kind == "HostKVEntry" for _, _, kind in kv_seen)
    if ckpt == "none":  # no recompute: every put is in a forward, before any K/V gradient exists
        assert all(device_bytes == 0 for _, device_bytes, _ in kv_seen)
    for r in runners:
        s = r.kv_store.host_tier.stats
        assert s.peak_bytes > 0 and s.copies_in >= s.copies_out > 0 and s.current_bytes == 0


def test_kv_offload_on_one_stage_with_offloaded_layers():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=33)
    batch = random_batch(LENGTHS, seed=33)
    plan = with_mix(make_plan(2, "1f1b", "none"), lambda s, u, n: CheckpointMix(offload=u % 2, full=s))
    runners, kv_seen = run(model, plan, batch, offload_kv=(1,))
    assert all(k == "HostKVEntry" for store, _, k in kv_seen if store is runners[1].kv_store)
    assert all(k == "KVEntry" for store, _, k in kv_seen if store is runners[0].kv_store)
    assert any(b > 0 for store, b, _ in kv_seen if store is runners[0].kv_store)
    assert all(r.kv_store.host_tier.current_bytes == 0 for r in runners)


def test_kv_brought_back_is_not_kept_by_the_graph_and_its_gradient_reaches_the_entry():
    import gc
    import weakref

    import torch

    from infinipipe_hf.runtime.attention.kv_store import HostKVEntry, KVStore

    store = KVStore()
    store.offload = True
    k, v = torch.randn(1, 2, 5, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    with torch.enable_grad():
        entry = store.put(0, 7, 0, 5, k, v)
        assert isinstance(entry, HostKVEntry) and store.bytes() == 0
        assert store.host_tier.current_bytes == 2 * k.numel() * 8
        ck, cv = store.context(0, 7, 5)
        assert torch.equal(ck, k) and ck.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        y = (ck * 3).sum() + (cv * cv).sum()
    gone = weakref.ref(ck)
    del ck
    gc.collect()
    assert gone() is None  # the device copy went with its last use (a leaf would stay in the graph)
    y.backward()
    gk, gv = entry.pending_grads()
    assert torch.equal(gk, torch.full_like(k, 3.0)) and torch.equal(gv, 2 * v)
    store.free_sequence(7)
    assert store.host_tier.current_bytes == 0
