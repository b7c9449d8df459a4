"""The ``offload_pair`` checkpoint level (``offload_attn`` in pairs whose second layer's input is
rebuilt in backward by a no-grad replay of the first layer) on CPU, float64, against the same plan
without checkpointing and against the unsplit HF model.

Host tier accounting per unit of ``N`` tokens (hidden 32, 4 heads, 8-byte values): a pair puts out
its first layer's input (``32 N`` values), both layers' attention outputs (``32 N`` each) and both
log-sum-exps (``4 N`` each): ``(3 * 32 + 2 * 4) * 8 * N`` bytes; an odd last layer of the run
keeps its input, as ``offload_attn``: ``(2 * 32 + 4) * 8 * N``.  Everything comes back once, and
each pair's rebuild reads its first layer's input and attention output once more with
``keep=True`` (not the log-sum-exp: a forward does not need it): bytes in = bytes out
+ ``(32 + 32) * 8 * N`` per pair.  Nothing is left after the step.
"""
import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from infinipipe_hf.ir.levels import OFFLOAD_ATTN, OFFLOAD_PAIR, CheckpointMix
from infinipipe_hf.ir.partition import partition_layers
from infinipipe_hf.runtime.offload import activation_hooks
from infinipipe_hf.runtime.offload.host_tier import HostTier
from infinipipe_hf.runtime.recompute.keep_attn import KeptAttention
from infinipipe_hf.runtime.recompute.offload_pair import pair_partners
from infinipipe_hf.runtime.stage.local import run_plan_locally
from infinipipe_hf.runtime.stage.module import build_stage
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, check, collect_grads, make_plan
from tests.helpers.reference import random_batch, tiny_model
from tests.runtime.offload.test_offload_attn import run_stages_with_tiers
from tests.runtime.offload.test_offload_levels import with_mix

HIDDEN, HEADS = 32, 4  # tiny_config's
INPUT, KEPT = HIDDEN * 8, (HIDDEN + HEADS) * 8  # bytes per token: a layer input; attention output + lse
REREAD = (HIDDEN + HIDDEN) * 8  # bytes per token and pair: the rebuild's reads of the first layer's


def tier_bytes(plan, stage) -> tuple[int, int, int, int]:
    """(bytes out, bytes in, copies out, copies in) of the plan's host levels on ``stage`` (module
    docstring): per unit, an ``offload_pair`` run of ``n`` layers puts out ``n - n // 2`` inputs
    and ``n`` attention outputs and log-sum-exps; ``offload_attn`` layers their input, output and
    lse; ``offload`` layers their input; each pair reads two of them once more."""
    out = back = copies_out = copies_in = 0
    for u in plan.units:
        m = plan.checkpoint_mix(stage, u.id)
        pairs = m.offload_pair // 2
        inputs, kept = m.offload + m.offload_attn + m.offload_pair - pairs, m.offload_attn + m.offload_pair
        out += u.num_tokens * (inputs * INPUT + kept * KEPT)
        back += u.num_tokens * (inputs * INPUT + kept * KEPT + pairs * REREAD)
        copies_out += inputs + 2 * kept
        copies_in += inputs + 2 * kept + 2 * pairs
    return out, back, copies_out, copies_in


def check_tier(tier, plan, stage) -> None:
    """The tier's stats are exactly :func:`tier_bytes`'s and it is empty."""
    out, back, copies_out, copies_in = tier_bytes(plan, stage)
    s = tier.stats
    assert (s.bytes_out, s.bytes_in, s.copies_out, s.copies_in) == (out, back, copies_out, copies_in), s
    assert out > 0 and s.current_bytes == 0 and 0 < s.peak_bytes <= out and not tier.live_tags(), s


def stages_and_plan(model, pp, num_layers, mix):
    """``num_layers`` split over ``pp`` stages, and the test plan with ``mix(stage, unit, layers)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stages = [build_stage(copy.deepcopy(model), i, r) for i, r in enumerate(partition_layers(num_layers, pp))]
    plan = make_plan(pp, "1f1b", "none")
    plan.layers_per_stage = [len(st.layer_indices) for st in stages]
    return stages, with_mix(plan, mix)


def assert_same(got, want, loss, want_loss):
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=0)
    assert set(got) == set(want)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("num_layers", [4, 5])  # stages of 4 / 2+2 layers, and of 5 / 2+3
@pytest.mark.parametrize("pp", [1, 2])
def test_every_layer_at_offload_pair_is_exact_and_round_trips_the_tier(pp, num_layers):
    model = tiny_model("llama", num_layers=num_layers, seed=50)
    batch = random_batch(LENGTHS, seed=50, with_labels=True)
    plain_stages, plain_plan = stages_and_plan(model, pp, num_layers, lambda s, u, n: CheckpointMix())
    plain_loss = run_plan_locally(plain_stages, plain_plan, batch, loss_chunk_tokens=5)
    stages, plan = stages_and_plan(model, pp, num_layers, lambda s, u, n: CheckpointMix(offload_pair=n))
    assert any(n % 2 for n in plan.layers_per_stage) == (num_layers == 5)  # an odd last layer
    loss, got, tiers = run_stages_with_tiers(stages, plan, batch)
    assert_same(got, collect_grads(plain_stages, False), loss, plain_loss)
    for s, tier in enumerate(tiers):
        check_tier(tier, plan, s)


PP1_MIXES = [CheckpointMix(offload_attn=1, offload_pair=2, offload=1),
             CheckpointMix(offload_pair=2, full=1, keep_attn=1), CheckpointMix(offload_pair=3, mlp=1),
             CheckpointMix(offload_pair=2, mlp_act=1, mlp=1), CheckpointMix(offload_attn=1, offload_pair=3),
             CheckpointMix()]
PP2_MIXES = [CheckpointMix(offload_pair=2), CheckpointMix(offload_pair=1, offload_attn=1),
             CheckpointMix(offload_pair=1, offload=1), CheckpointMix(offload_pair=1, full=1),
             CheckpointMix(offload_pair=1, keep_attn=1), CheckpointMix(offload_pair=1, mlp=1),
             CheckpointMix(offload_pair=1, mlp_act=1), CheckpointMix()]


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_offload_pair_mixed_with_every_level(family, pp):
    """Against the unsplit HF model (the stages' own tiers checked in a second run)."""
    tied = family == "qwen2"
    model = tiny_model(family, num_layers=NUM_LAYERS, seed=51, tie=tied)
    batch = random_batch(LENGTHS, seed=51)
    mixes = PP1_MIXES if pp == 1 else PP2_MIXES
    plan = with_mix(make_plan(pp, "gpipe", "none"), lambda s, u, n: mixes[(s + u) % len(mixes)])
    check(model, build_stages(model, pp), plan, batch, tied=tied)
    _, _, tiers = run_stages_with_tiers(build_stages(model, pp), plan, batch)
    for s, tier in enumerate(tiers):
        check_tier(tier, plan, s)


def test_offload_pair_with_attention_and_mlp_tiles_is_exact():
    """Attention side and MLP in tiles, an offload_attn layer, a pair and an odd last layer."""
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=52)
    batch = random_batch(LENGTHS, seed=52, with_labels=True)
    plain_stages = build_stages(model, 1)
    plain_loss = run_plan_locally(plain_stages, make_plan(1, "1f1b", "none"), batch, loss_chunk_tokens=5)
    plan = with_mix(make_plan(1, "1f1b", "none"), lambda s, u, n: CheckpointMix(offload_attn=1, offload_pair=3))
    plan.attention_tile_tokens = {u.id: 3 for u in plan.units}
    plan.mlp_tile_tokens = {u.id: 2 for u in plan.units}
    loss, got, (tier,) = run_stages_with_tiers(build_stages(model, 1), plan, batch)
    assert_same(got, collect_grads(plain_stages, False), loss, plain_loss)
    check_tier(tier, plan, 0)


@pytest.mark.parametrize("mix", [CheckpointMix(offload_pair=4), CheckpointMix(offload_attn=1, offload_pair=3)])
def test_second_inputs_are_rebuilt_and_nothing_stays_on_the_device(monkeypatch, mix):
    """One stage, GPipe order.  After each unit's forward: the tier holds what the level keeps,
    no device copy of a put tensor nor of any layer input survives, and no second layer's input
    went to the tier.  In backward each pair rebuilds its second layer's input exactly once, equal
    to the forward's; the attention module runs once more per pair, the attention kernel never."""
    from infinipipe_hf.runtime.attention import kept_kernels

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=53)
    batch = random_batch(LENGTHS, seed=53, with_labels=True)
    plan = with_mix(make_plan(1, "gpipe", "none"), lambda s, u, n: mix)
    (stage,) = build_stages(model, 1)
    runner = StageRunner(stage, loss_chunk_tokens=5)
    backend, backend_calls = runner.backend, []
    runner.backend = lambda a: (backend_calls.append(1), backend(a))[1]  # every layer's core is kept
    runner.begin_step(plan, batch, label_token_count(batch))
    tier = runner.kv_store.host_tier
    seconds = set(pair_partners(mix.layer_levels(NUM_LAYERS)))
    pairs, inputs = len(seconds), NUM_LAYERS - len(seconds)
    sent, layer_inputs, second_refs, second_inputs, rebuilt, kernel_calls, attn_calls = [], [], [], [], [], [], []
    put, real_kernel, real_unpack = tier.put, kept_kernels._FLASH_CPU, activation_hooks._Rebuilt.unpack

    def spy_put(t, tag=None):
        assert not any(t is ref() for ref in second_refs), "a second layer's input went to the tier"
        sent.append(weakref.ref(t))
        return put(t, tag)

    def counting_kernel(*args, **kwargs):
        kernel_calls.append(args[0].shape[2])
        return real_kernel(*args, **kwargs)

    def recording_unpack(self):
        first = self.back is None
        out = real_unpack(self)
        if first:
            rebuilt.append(out.clone())
        return out

    monkeypatch.setattr(tier, "put", spy_put)
    monkeypatch.setattr(kept_kernels, "_FLASH_CPU", counting_kernel)
    monkeypatch.setattr(activation_hooks._Rebuilt, "unpack", recording_unpack)

    def pre_hook(i):
        def hook(module, args):
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # a replay in backward
            layer_inputs.append(weakref.ref(args[0]))
            if i in seconds:
                second_refs.append(weakref.ref(args[0]))
                second_inputs.append(args[0].detach().clone())
        return hook

    for i, (_, layer) in enumerate(stage.decoder_layers()):
        layer.register_forward_pre_hook(pre_hook(i))
        layer.self_attn.register_forward_pre_hook(lambda m, a: attn_calls.append(1))
    held = 0
    for u in plan.units:  # every forward, then every backward
        sent.clear()
        layer_inputs.clear()
        runner.forward(u.id, None)
        gc.collect()
        held += u.num_tokens * (inputs * INPUT + NUM_LAYERS * KEPT)
        assert tier.current_bytes == held
        assert len(sent) == inputs + 2 * NUM_LAYERS and all(ref() is None for ref in sent)
        assert len(layer_inputs) == NUM_LAYERS and all(ref() is None for ref in layer_inputs)
    assert not rebuilt
    for u in reversed(plan.units):
        runner.backward(u.id, None)
        held -= u.num_tokens * (inputs * INPUT + NUM_LAYERS * KEPT)
        assert tier.current_bytes == held
    runner.end_step()
    check_tier(tier, plan, 0)
    assert len(rebuilt) == len(second_inputs) == pairs * len(plan.units)
    # backward runs the units and a unit's layers in reverse: the rebuilds come in reverse order
    for got, want in zip(rebuilt, reversed(second_inputs)):
        assert torch.equal(got, want)
    assert len(attn_calls) == (2 * NUM_LAYERS + pairs) * len(plan.units)  # replays and rebuilds ...
    want = sorted(s.end - s.start for u in plan.units for s in u.segments for _ in range(NUM_LAYERS))
    assert sorted(kernel_calls) == want and not backend_calls  # ... but each core ran once, in the forward


def test_pair_partners():
    P, A = OFFLOAD_PAIR, OFFLOAD_ATTN
    assert pair_partners([P, P, P, P]) == {1: 0, 3: 2}
    assert pair_partners([A, P, P, P, None]) == {2: 1}  # layer 3: no partner, keeps its input
    assert pair_partners([P, "full"]) == {} and pair_partners([None]) == {}
    with pytest.raises(ValueError, match="consecutive"):
        pair_partners([P, "full", P])


def test_rebuild_hooks_on_two_functions():
    """The hooks alone: ``g(f(x))`` with ``f``'s input in the tier and ``g``'s rebuilt by replaying
    ``f``: the gradient of ``x`` is exact, ``g``'s input never enters the tier, and a graph freed
    without its backward leaves nothing behind."""
    def f(x):
        return x.sin() * 3

    def g(y):
        return (y * y).cos()

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(g(f(x)).sum(), x)
    tier, replays = HostTier(), []

    def replay(t):
        replays.append(1)
        with torch.no_grad():
            return f(t)

    def forward():
        record = []
        with activation_hooks.offload_saved(tier, 0, record):
            y = checkpoint(f, x, use_reentrant=False)
        with activation_hooks.rebuild_saved(y, record[-1], replay, tier, 0):
            return checkpoint(g, y, use_reentrant=False)

    (got,) = torch.autograd.grad(forward().sum(), x)
    assert torch.equal(got, want) and replays == [1]
    s = tier.stats
    assert (s.bytes_out, s.bytes_in, s.copies_in, s.current_bytes) == (48, 96, 2, 0), s
    out = forward()
    assert tier.current_bytes == 48
    del out
    gc.collect()
    assert tier.current_bytes == 0 and not tier.live_tags() and replays == [1]


def test_host_store_peek_leaves_the_entry():
    tier = HostTier()
    store = KeptAttention(host_tier=tier, tag=3)
    out, lse = torch.randn(1, 5, 4, 8, dtype=torch.float64), torch.randn(1, 4, 5, dtype=torch.float64)
    store.put(0, out, lse)
    for _ in range(2):
        assert torch.equal(store.peek(0), out) and len(store) == 1
    assert tier.current_bytes == (out.numel() + lse.numel()) * 8 and tier.stats.bytes_in == 2 * out.numel() * 8
    back_out, back_lse, _ = store.pop(0)
    assert torch.equal(back_out, out) and torch.equal(back_lse, lse) and tier.current_bytes == 0
    assert store.peek(0) is None
    with store.peeking(), pytest.raises(RuntimeError, match="offload_pair rebuild"):
        store.run(None, 0)
    assert not store.peeking_now
    device = KeptAttention()
    device.put(1, out, lse)
    assert device.peek(1) is out and len(device) == 1


def test_offload_pair_runs_where_offload_attn_runs():
    from types import SimpleNamespace

    from infinipipe_hf.config import InfiniPipeConfig
    from infinipipe_hf.runtime.engine.planning import runnable_checkpoint_levels
    from infinipipe_hf.runtime.recompute.layers import runnable_levels

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=54)
    (stage,) = build_stages(model, 1)
    layers = [layer for _, layer in stage.decoder_layers()]
    every = ("offload_attn", "offload_pair", "offload", "keep_attn", "mlp")
    assert runnable_levels(every, layers, torch.device("cpu")) == (every, None)
    kept, why = runnable_levels(every, layers, torch.device("cuda"), torch.float32)
    assert kept == ("offload", "mlp") and "offload_pair (keep_attn in host memory, in pairs)" in why
    for layer in layers:
        layer.self_attn.attention_dropout = 0.1
    kept, why = runnable_levels(("offload_pair", "offload"), layers, torch.device("cpu"))
    assert kept == ("offload",) and "offload_pair" in why and "attention_dropout=0.1" in why
    engine = SimpleNamespace(config=InfiniPipeConfig(), stage=stage, device=torch.device("cpu"),
                             dtype=torch.float64)
    with pytest.warns(UserWarning, match="attention_dropout=0.1.*offload_attn and offload_pair"):
        assert runnable_checkpoint_levels(engine) == ("mlp", "mlp_act")
