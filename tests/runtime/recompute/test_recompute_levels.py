"""Checkpoint levels (runtime/recompute/mlp_levels.py, runtime/recompute/keep_attn.py) against the
unsplit HF model, float64.

Every level, alone and mixed with whole layers in one plan, over slices carrying K/V, a hybrid
and packed units, under 1F1B and GPipe-like orders, for every supported family, and with LoRA on
every projection: loss and every gradient equal the reference (1e-10 relative).  Counting module
calls checks the levels do recompute what they claim (and only that), so a level that silently
keeps everything, reruns ``down_proj``, or (``keep_attn``) reruns the attention core, fails.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infinipipe_hf.runtime.recompute.mlp_levels import install_mlp_levels, mlp_level, supports_levels
from infinipipe_hf.runtime.stage.local import run_plan_locally
from tests.helpers.local_pipeline import (
    LENGTHS,
    MIX_CYCLE,
    NUM_LAYERS,
    build_stages,
    check,
    collect_grads,
    make_plan,
    with_levels,
)
from tests.helpers.reference import FAMILIES, random_batch, reference_loss_and_grads, tiny_model


@pytest.mark.parametrize("level", ["keep_attn", "mlp", "mlp_act"])
@pytest.mark.parametrize("pp", [1, 2])
def test_each_level_alone_on_every_layer(level, pp):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=20)
    batch = random_batch(LENGTHS, seed=20, with_labels=True)
    plan = make_plan(pp, "1f1b", "none")
    per = NUM_LAYERS // pp
    plan.checkpoint_levels = {s: {u.id: {level: per} for u in plan.units} for s in range(pp)}
    check(model, build_stages(model, pp), plan, batch)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_mixed_levels_in_one_plan(family, order):
    model = tiny_model(family, num_layers=NUM_LAYERS, seed=21)
    batch = random_batch(LENGTHS, seed=21)
    plan = with_levels(make_plan(2, order, "none"), MIX_CYCLE)
    assert plan.checkpoint_levels and any(plan.checkpoint_layers[s][u] for s in (0, 1) for u in range(5))
    check(model, build_stages(model, 2), plan, batch, chunk=3)


def test_mixed_levels_pp4_one_layer_per_stage_and_tied():
    model = tiny_model("qwen2", num_layers=NUM_LAYERS, seed=22, tie=True)
    batch = random_batch(LENGTHS, seed=22, with_labels=True)
    plan = with_levels(make_plan(4), [(1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 0, 1), (0, 0, 0)])
    check(model, build_stages(model, 4), plan, batch, tied=True)


def test_dp_replicas_with_levels():
    model = tiny_model("mistral", num_layers=NUM_LAYERS, seed=23)
    lengths = LENGTHS * 2
    batch = random_batch(lengths, seed=23)
    plan = with_levels(make_plan(2, dp=2, lengths=lengths), MIX_CYCLE)
    check(model, build_stages(model, 2), plan, batch)


def test_lora_on_every_projection_with_levels():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=24)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    batch = random_batch(LENGTHS, seed=24)
    ref_loss, ref = reference_loss_and_grads(pm, batch)
    ref = {n.removeprefix("base_model.model."): g for n, g in ref.items()}
    assert any("mlp.down_proj.lora_B" in n for n in ref)
    stages = build_stages(pm, 2)
    assert all(supports_levels(layer) for st in stages for _, layer in st.decoder_layers())
    plan = with_levels(make_plan(2), MIX_CYCLE)
    loss = run_plan_locally(stages, plan, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    from tests.helpers.reference import assert_grads_close

    got = collect_grads(stages, False)
    assert set(got) == set(ref)
    assert_grads_close(got, ref)


class ForwardGemms(TorchDispatchMode):
    """Counts forward GEMMs (``x @ W.t()``) per weight: the replays a level really runs.

    Module hooks cannot tell: a checkpoint replay enters ``down_proj`` and stops inside it, before
    its GEMM, once ``down_proj``'s input is rebuilt.  MLP weights are not square, so a backward GEMM
    (``grad @ W``, ``W`` untransposed) never matches."""

    def __init__(self, weights):
        super().__init__()
        self.keys = {(w.data_ptr(), tuple(w.t().shape)): name for name, w in weights.items()}
        self.count = {name: 0 for name in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            mat2 = args[-1]
            name = self.keys.get((mat2.data_ptr(), tuple(mat2.shape)))
            if name is not None:
                self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _act_calls(stages):
    calls = {}
    for st in stages:
        for idx, layer in st.decoder_layers():
            layer.mlp.act_fn.register_forward_pre_hook(
                lambda m, a, idx=idx: calls.__setitem__(idx, calls.get(idx, 0) + 1))
    return calls


def test_levels_recompute_what_they_claim():
    """Stage 0 holds layers 0 and 1: unit 0 whole-checkpoints layer 0 and recomputes layer 1's
    MLP; unit 1 recomputes act*mul in both layers; the rest keep everything."""
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=25)
    stages = build_stages(model, 2)
    plan = make_plan(2, "1f1b", "none")
    plan.checkpoint_layers = {0: {0: 1}}
    plan.checkpoint_levels = {0: {0: {"mlp": 1}, 1: {"mlp_act": 2}}}
    weights = {(idx, part): getattr(layer.mlp, part).weight for st in stages
               for idx, layer in st.decoder_layers() for part in ("gate_proj", "up_proj", "down_proj")}
    acts = _act_calls(stages)
    with ForwardGemms(weights) as gemms:
        check(model, stages, plan, random_batch(LENGTHS, seed=25), chunk=1000)
    n, calls = len(plan.units), gemms.count
    # Layer 0: unit 0 reruns the whole layer, whose replay also stops before down_proj's GEMM
    # (the residual add after it saves nothing); unit 1 reruns act only.
    assert [calls[(0, p)] for p in ("gate_proj", "up_proj", "down_proj")] == [n + 1, n + 1, n]
    assert acts[0] == n + 2
    # Layer 1: unit 0 reruns gate and up (never down_proj); unit 1 reruns act only.
    assert [calls[(1, p)] for p in ("gate_proj", "up_proj", "down_proj")] == [n + 1, n + 1, n]
    assert acts[1] == n + 2
    # Stage 1 keeps everything.
    assert all(calls[(i, p)] == n for i in (2, 3) for p in ("gate_proj", "up_proj", "down_proj"))
    assert acts[2] == acts[3] == n


def test_keep_attn_replays_the_layer_but_not_the_attention_core(monkeypatch):
    """Layer 0 of every unit at keep_attn: the layer is replayed in backward (its attention module
    runs twice per unit) but the attention kernel runs once per segment, in the first forward;
    every store is empty after backward (nothing kept past the unit's backward)."""
    from infinipipe_hf.runtime.attention import kept_kernels as attention_kept_kernels
    from infinipipe_hf.runtime.recompute import layers as checkpointing

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=29)
    stages = build_stages(model, 2)
    plan = make_plan(2, "1f1b", "none")
    plan.checkpoint_levels = {0: {u.id: {"keep_attn": 1} for u in plan.units}}
    kernel_calls, stores = [], []
    real_kernel, real_store = attention_kept_kernels._FLASH_CPU, checkpointing.KeptAttention

    def counting_kernel(*args, **kwargs):
        kernel_calls.append(args[0].shape[2])
        return real_kernel(*args, **kwargs)

    class RecordedStore(real_store):
        def __init__(self):
            super().__init__()
            stores.append(self)

    monkeypatch.setattr(attention_kept_kernels, "_FLASH_CPU", counting_kernel)
    monkeypatch.setattr(checkpointing, "KeptAttention", RecordedStore)
    attn_calls = {}
    for st in stages:
        for idx, layer in st.decoder_layers():
            layer.self_attn.register_forward_pre_hook(
                lambda m, a, idx=idx: attn_calls.__setitem__(idx, attn_calls.get(idx, 0) + 1))
    check(model, stages, plan, random_batch(LENGTHS, seed=29))
    n = len(plan.units)
    assert attn_calls[0] == 2 * n and attn_calls[1] == attn_calls[2] == attn_calls[3] == n
    # One kernel call per segment of every unit, each over the segment's query tokens: no replay.
    assert sorted(kernel_calls) == sorted(s.end - s.start for u in plan.units for s in u.segments)
    assert len(stores) == n and all(len(st) == 0 for st in stores)


def test_levels_the_device_or_model_cannot_run_are_dropped_with_the_reason():
    from infinipipe_hf.runtime.recompute.layers import runnable_levels

    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=30)
    layers = [layer for st in build_stages(model, 1) for _, layer in st.decoder_layers()]
    every = ("keep_attn", "mlp", "mlp_act")
    assert runnable_levels(every, layers, torch.device("cpu")) == (every, None)
    kept, why = runnable_levels(every, layers, torch.device("cuda"), torch.float32)
    assert kept == ("mlp", "mlp_act") and "float16 or bfloat16" in why
    layers[0].self_attn.attention_dropout = 0.1
    kept, why = runnable_levels(every, layers, torch.device("cpu"))
    assert kept == ("mlp", "mlp_act") and "attention_dropout=0.1" in why
    layers[0].self_attn.attention_dropout = 0.0
    layers[1].mlp = torch.nn.Linear(4, 4)  # not a gated MLP: the MLP levels go, keep_attn stays
    kept, why = runnable_levels(every, layers, torch.device("cpu"))
    assert kept == ("keep_attn",) and why.count("gated MLP") == 1


def test_forward_only_ignores_levels():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=26)
    stages = build_stages(model, 1)
    plan = with_levels(make_plan(1), MIX_CYCLE)
    calls = _act_calls(stages)
    ref_loss, _ = reference_loss_and_grads(model, random_batch(LENGTHS, seed=26))
    from infinipipe_hf.runtime.stage.runner import StageRunner
    from infinipipe_hf.runtime.stage.unit_tensors import label_token_count

    batch = random_batch(LENGTHS, seed=26)
    runner = StageRunner(stages[0])
    runner.begin_step(plan, batch, label_token_count(batch))
    loss = sum(float(runner.forward_only(u.id, None)) for u in plan.units)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert set(calls.values()) == {len(plan.units)}


def test_too_many_layers_and_unknown_levels_are_errors():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=27)
    stages = build_stages(model, 2)
    plan = make_plan(2, "1f1b", "none")
    plan.checkpoint_layers = {0: {0: 1}}
    plan.checkpoint_levels = {0: {0: {"mlp": 1, "mlp_act": 1}}}  # 3 levels on a 2-layer stage
    with pytest.raises(ValueError, match="stage 0, which has 2 layers"):
        run_plan_locally(stages, plan, random_batch(LENGTHS))
    plan = make_plan(2, "1f1b", "none")
    plan.checkpoint_levels = {1: {2: {"attention": 1}}}
    with pytest.raises(ValueError, match="unknown checkpoint level 'attention'"):
        run_plan_locally(build_stages(model, 2), plan, random_batch(LENGTHS))


def test_unswitchable_mlp_is_a_clear_error():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(4, 4)  # no gate/up/down: not a gated MLP

    layer = Layer()
    assert not install_mlp_levels(layer) and not supports_levels(layer)
    with pytest.raises(ValueError, match="no switchable gated MLP.*checkpoint_levels=\\(\\)"):
        with mlp_level(layer, "mlp"):
            pass
    with mlp_level(layer, None):  # no level: nothing to switch, no error
        pass


def test_names_and_state_dict_unchanged_by_the_switch():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=28)
    names = [n for n, _ in model.named_parameters()]
    stages = build_stages(model, 1)
    assert [n for n, _ in stages[0].named_parameters()] == names
    mlp = stages[0].hf_model.model.layers["0"].mlp
    assert type(mlp).__name__ == "LlamaMLP" and "forward" in vars(mlp)
    assert install_mlp_levels(stages[0].hf_model.model.layers["0"])  # idempotent
