"""The ``offload_attn`` checkpoint level (``keep_attn`` with what it keeps in the host tier) on CPU,
float64, against the unsplit HF model and against the same plan without checkpointing.

Per layer and unit the stage's host tier receives the layer input (hidden), the attention output
(heads x head_dim) and the per-head log-sum-exp (float64 on the CPU kernel), and gives all of them
back: bytes in == bytes out, nothing left after the step.  Between a unit's forward and its
backward every tensor put in the tier has lost its device copy (weak references to them die) and
the unit's store reports no device tensor; the attention kernel runs once per segment (the replay
skips the core), the attention module twice.
"""
import gc
import weakref

import pytest
import torch

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.runtime.offload.host_tier import HostTier
from infinipipe_hf.runtime.recompute.keep_attn import KeptAttention
from infinipipe_hf.runtime.stage.local import _run_replica, run_plan_locally
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, check, collect_grads, make_plan
from tests.helpers.reference import random_batch, tiny_model
from tests.runtime.offload.test_offload_levels import check_round_trip, with_mix

HIDDEN, HEADS = 32, 4  # tiny_config's
HOST_BYTES_PER_TOKEN = (HIDDEN + HIDDEN + HEADS) * 8  # input + attention output + lse, float64


def host_bytes(plan, stage) -> int:
    """What the plan's host levels put out on ``stage``: per layer and unit, the input (both
    levels) and, at ``offload_attn``, the attention output and log-sum-exp."""
    total = 0
    for u in plan.units:
        m = plan.checkpoint_mix(stage, u.id)
        total += u.num_tokens * (m.offload_attn * HOST_BYTES_PER_TOKEN + m.offload * HIDDEN * 8)
    return total


def run_with_tiers(model, plan, batch):
    """Run the plan on fresh stages of ``model`` (:func:`run_stages_with_tiers`)."""
    return run_stages_with_tiers(build_stages(model, plan.pp_degree), plan, batch)


def run_stages_with_tiers(stages, plan, batch):
    """Loss, gradients and the runners' host tiers after running ``plan`` on ``stages``."""
    runners = [StageRunner(st, loss_chunk_tokens=5) for st in stages]
    for r in runners:
        r.begin_step(plan, batch, label_token_count(batch))
    loss = sum(_run_replica(runners, plan, d) for d in sorted(plan.actions))
    for r in runners:
        r.end_step()
    return loss, collect_grads(stages, False), [r.kv_store.host_tier for r in runners]


@pytest.mark.parametrize("pp", [1, 2])
def test_every_layer_at_offload_attn_is_exact_and_round_trips_the_tier(pp):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=40)
    batch = random_batch(LENGTHS, seed=40, with_labels=True)
    plain_stages = build_stages(model, pp)
    plain_loss = run_plan_locally(plain_stages, make_plan(pp, "1f1b", "none"), batch, loss_chunk_tokens=5)
    plain = collect_grads(plain_stages, False)
    plan = with_mix(make_plan(pp, "1f1b", "none"), lambda s, u, n: CheckpointMix(offload_attn=n))
    loss, got, tiers = run_with_tiers(model, plan, batch)
    assert loss == pytest.approx(plain_loss, rel=1e-12, abs=0)
    assert set(got) == set(plain)
    for name, g in got.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-12, atol=1e-14, msg=name)
    for s, tier in enumerate(tiers):
        check_round_trip(tier, host_bytes(plan, s))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_offload_attn_mixed_with_every_level(family):
    model = tiny_model(family, num_layers=NUM_LAYERS, seed=41, tie=family == "qwen2")
    batch = random_batch(LENGTHS, seed=41)
    mixes = [CheckpointMix(offload_attn=1, offload=1), CheckpointMix(offload_attn=1, keep_attn=1),
             CheckpointMix(offload_attn=1, full=1), CheckpointMix(offload_attn=1, mlp=1),
             CheckpointMix(offload_attn=2), CheckpointMix(offload_attn=1, mlp_act=1), CheckpointMix()]
    plan = with_mix(make_plan(2, "gpipe", "none"), lambda s, u, n: mixes[(s + u) % len(mixes)])
    stages = build_stages(model, 2)
    check(model, stages, plan, batch, tied=family == "qwen2")
    _, _, tiers = run_with_tiers(model, plan, batch)
    for s, tier in enumerate(tiers):
        st = tier.stats
        assert st.bytes_out == st.bytes_in == host_bytes(plan, s) > 0 and st.current_bytes == 0, st


def test_nothing_kept_on_the_device_between_forward_and_backward(monkeypatch):
    """One stage: after each unit's forward the tier holds exactly its inputs, attention outputs
    and log-sum-exps more, whose device copies are gone; its store reports no device tensor; each
    backward brings its unit's back, and the attention kernel never reran."""
    from infinipipe_hf.runtime.attention import kept_kernels
    from infinipipe_hf.runtime.recompute import layers as checkpointing

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=42)
    batch = random_batch(LENGTHS, seed=42, with_labels=True)
    plan = with_mix(make_plan(1, "gpipe", "none"), lambda s, u, n: CheckpointMix(offload_attn=n))
    (stage,) = build_stages(model, 1)
    runner = StageRunner(stage, loss_chunk_tokens=5)
    runner.begin_step(plan, batch, label_token_count(batch))
    tier = runner.kv_store.host_tier
    put, sent, stores, kernel_calls = tier.put, [], [], []
    real_kernel, real_store = kept_kernels._FLASH_CPU, checkpointing.KeptAttention

    def spy_put(t, tag=None):
        sent.append(weakref.ref(t))
        return put(t, tag)

    class RecordedStore(real_store):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            stores.append(self)

    def counting_kernel(*args, **kwargs):
        kernel_calls.append(args[0].shape[2])
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(tier, "put", spy_put)
    monkeypatch.setattr(checkpointing, "KeptAttention", RecordedStore)
    monkeypatch.setattr(kept_kernels, "_FLASH_CPU", counting_kernel)
    attn_calls = []
    for _, layer in stage.decoder_layers():
        layer.self_attn.register_forward_pre_hook(lambda m, a: attn_calls.append(1))
    held = 0
    for u in plan.units:  # GPipe order: every forward, then every backward
        sent.clear()
        runner.forward(u.id, None)
        gc.collect()
        held += u.num_tokens * NUM_LAYERS * HOST_BYTES_PER_TOKEN
        assert tier.current_bytes == held
        assert len(sent) == 3 * NUM_LAYERS and all(ref() is None for ref in sent)  # no device copy left
        assert stores[-1].host_tier is tier and len(stores[-1]) == NUM_LAYERS and stores[-1].tensors() == []
    for u, store in zip(reversed(plan.units), reversed(stores)):
        runner.backward(u.id, None)  # the last stage backpropagates its own loss
        held -= u.num_tokens * NUM_LAYERS * HOST_BYTES_PER_TOKEN
        assert tier.current_bytes == held and len(store) == 0
    runner.end_step()
    assert tier.stats.bytes_in == tier.stats.bytes_out
    assert len(attn_calls) == 2 * NUM_LAYERS * len(plan.units)  # every layer replayed in backward ...
    want = sorted(s.end - s.start for u in plan.units for s in u.segments for _ in range(NUM_LAYERS))
    assert sorted(kernel_calls) == want  # ... but its attention core ran once, in the forward


def test_host_store_round_trip_and_release():
    tier = HostTier()
    store = KeptAttention(host_tier=tier, tag=3)
    out, lse = torch.randn(1, 5, 4, 8, dtype=torch.float64), torch.randn(1, 4, 5, dtype=torch.float64)
    store.put(0, out, lse, (torch.empty(0),))
    assert tier.current_bytes == (out.numel() + lse.numel()) * 8 and store.tensors() == [] and len(store) == 1
    back_out, back_lse, aux = store.pop(0)
    assert torch.equal(back_out, out) and torch.equal(back_lse, lse) and aux[0].numel() == 0
    assert back_out.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    assert tier.current_bytes == 0 and store.pop(0) is None
    store.put(1, out, lse)
    del store  # a graph freed without its backward: the host copies go with the store
    gc.collect()
    assert tier.current_bytes == 0 and not tier.live_tags()
    device = KeptAttention()  # keep_attn's store keeps its tensors as they are
    device.put(0, out, lse)
    assert device.tensors()[0] is out and device.pop(0)[1] is lse


def test_offload_attn_runs_where_keep_attn_runs():
    from infinipipe_hf.runtime.recompute.layers import runnable_levels

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=43)
    layers = [layer for st in build_stages(model, 1) for _, layer in st.decoder_layers()]
    every = ("offload_attn", "offload", "keep_attn", "mlp")
    assert runnable_levels(every, layers, torch.device("cpu")) == (every, None)
    kept, why = runnable_levels(every, layers, torch.device("cuda"), torch.float32)
    assert kept == ("offload", "mlp") and "offload_attn" in why and "float16 or bfloat16" in why
    layers[0].self_attn.attention_dropout = 0.1
    kept, why = runnable_levels(("offload_attn",), layers, torch.device("cpu"))
    assert kept == () and "offload_attn" in why and "attention_dropout=0.1" in why


def test_the_engine_warns_that_a_dropped_keep_attn_takes_offload_attn_along():
    """The planner offers ``offload_attn`` only beside ``keep_attn``: the engine's warning says so."""
    from types import SimpleNamespace

    from infinipipe_hf.config import InfiniPipeConfig
    from infinipipe_hf.runtime.engine.planning import runnable_checkpoint_levels

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=44)
    (stage,) = build_stages(model, 1)
    for _, layer in stage.decoder_layers():
        layer.self_attn.attention_dropout = 0.1
    engine = SimpleNamespace(config=InfiniPipeConfig(), stage=stage, device=torch.device("cpu"),
                             dtype=torch.float64)
    with pytest.warns(UserWarning, match="attention_dropout=0.1.*offload_attn"):
        assert runnable_checkpoint_levels(engine) == ("mlp", "mlp_act")
    assert engine.config.checkpoint_levels == ("mlp", "mlp_act")


def test_offload_attn_with_attention_and_mlp_tiles_is_exact():
    """The whole-sequence plan's layers (attention side and MLP in tiles) at ``offload_attn``: exact,
    and the tier round-trips what the level keeps."""
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=42)
    batch = random_batch(LENGTHS, seed=42, with_labels=True)
    plain_stages = build_stages(model, 1)
    plain_loss = run_plan_locally(plain_stages, make_plan(1, "1f1b", "none"), batch, loss_chunk_tokens=5)
    plain = collect_grads(plain_stages, False)
    plan = with_mix(make_plan(1, "1f1b", "none"), lambda s, u, n: CheckpointMix(offload_attn=n))
    plan.attention_tile_tokens = {u.id: 3 for u in plan.units}
    plan.mlp_tile_tokens = {u.id: 3 for u in plan.units}
    loss, got, (tier,) = run_with_tiers(model, plan, batch)
    assert loss == pytest.approx(plain_loss, rel=1e-12, abs=0)
    for name, g in got.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-12, atol=1e-14, msg=name)
    assert tier.stats.bytes_out == tier.stats.bytes_in == host_bytes(plan, 0) and tier.stats.current_bytes == 0
