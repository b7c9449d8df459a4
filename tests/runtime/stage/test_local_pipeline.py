"""Local (one-process) pipeline vs the unsplit HF model in float64: loss and every gradient.

Hand-built plans (``tests/helpers/local_pipeline.py``) mix slice units (a long sequence cut at
unequal points), a hybrid unit (tail slice + whole short sequence) and packed units, under
GPipe-like and 1F1B-like orders and with none / some / all layers checkpointed.
"""
import pytest
import torch

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.runtime.stage.local import run_plan_locally
from infinipipe_hf.runtime.stage.module import build_stage
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, check, collect_grads, make_plan
from tests.helpers.reference import FAMILIES, assert_grads_close, random_batch, reference_loss_and_grads, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_families_and_stage_counts(family, pp):
    model = tiny_model(family, num_layers=NUM_LAYERS)
    batch = random_batch(LENGTHS, with_labels=True)
    check(model, build_stages(model, pp), make_plan(pp), batch)


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ckpt", ["none", "some", "all"])
@pytest.mark.parametrize("pp", [2, 4])
def test_orders_and_checkpointing(order, ckpt, pp):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=1)
    batch = random_batch(LENGTHS, seed=1)
    check(model, build_stages(model, pp), make_plan(pp, order, ckpt), batch, chunk=1000)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_tied_embeddings(family, pp):
    model = tiny_model(family, num_layers=NUM_LAYERS, tie=True, seed=2)
    stages = build_stages(model, pp)
    if pp > 1:
        assert stages[0].tied_parameter_names == ["model.embed_tokens.weight"]
        assert stages[-1].tied_parameter_names == ["lm_head.weight"]
        assert stages[-1].hf_model.model.embed_tokens is None
        torch.testing.assert_close(stages[-1].hf_model.lm_head.weight,
                                   stages[0].hf_model.model.embed_tokens.weight, rtol=0, atol=0)
    else:
        assert stages[0].tied_parameter_names == []
        hf = stages[0].hf_model
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    check(model, stages, make_plan(pp), random_batch(LENGTHS, seed=2, with_labels=True), tied=True)


@pytest.mark.parametrize("pp", [1, 2])
def test_mistral_sliding_window_across_slices(pp):
    model = tiny_model("mistral", num_layers=NUM_LAYERS, seed=10)
    model.config.sliding_window = 5  # shorter than the slices and their contexts
    batch = random_batch(LENGTHS, seed=10)
    ref_loss, _ = reference_loss_and_grads(model, batch)
    model.config.sliding_window = None
    full_loss, _ = reference_loss_and_grads(model, batch)
    assert abs(full_loss - ref_loss) > 1e-6  # the window matters for this batch
    model.config.sliding_window = 5
    check(model, build_stages(model, pp), make_plan(pp), batch)


def test_user_labels_as_tensors_with_ignored_targets():
    model = tiny_model("mistral", num_layers=NUM_LAYERS, seed=3)
    batch = random_batch(LENGTHS, seed=3, with_labels=True)
    batch = [{"input_ids": torch.tensor(b["input_ids"]), "labels": torch.tensor(b["labels"])} for b in batch]
    assert any((b["labels"] == -100).any() for b in batch)
    ref_batch = [{k: v.tolist() for k, v in b.items()} for b in batch]
    stages = build_stages(model, 2)
    ref_loss, ref = reference_loss_and_grads(model, ref_batch)
    loss = run_plan_locally(stages, make_plan(2), batch, loss_chunk_tokens=2)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert_grads_close(collect_grads(stages, False), ref)


def test_dp_replicas_accumulate_on_the_same_stages():
    model = tiny_model("qwen3", num_layers=NUM_LAYERS, seed=4)
    lengths = LENGTHS * 2
    batch = random_batch(lengths, seed=4)
    plan = make_plan(2, dp=2, lengths=lengths)
    check(model, build_stages(model, 2), plan, batch)


def test_checkpointed_layers_are_recomputed():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=5)
    pp = 2
    stages = build_stages(model, pp)
    plan = make_plan(pp, "1f1b", "none")
    plan.checkpoint_layers = {0: {0: 2, 1: 1}, 1: {2: 1}}  # checkpointed layers per (stage, unit)
    calls = {}
    for st in stages:
        for idx, layer in st.decoder_layers():
            layer.register_forward_pre_hook(lambda m, a, idx=idx: calls.__setitem__(idx, calls.get(idx, 0) + 1))
    batch = random_batch(LENGTHS, seed=5)
    check(model, stages, plan, batch)
    n_units = len(plan.units)
    # stage 0 holds layers 0,1: unit 0 recomputes both, unit 1 recomputes layer 0.
    assert calls[0] == n_units + 2 and calls[1] == n_units + 1
    # stage 1 holds layers 2,3: unit 2 recomputes layer 2.
    assert calls[2] == n_units + 1 and calls[3] == n_units


def test_runner_frees_kv_and_checks_pending():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=6)
    (stage,) = build_stages(model, 1)
    plan = make_plan(1)
    batch = random_batch(LENGTHS, seed=6)
    runner = StageRunner(stage, loss_chunk_tokens=4)
    runner.begin_step(plan, batch, label_token_count(batch))
    assert runner.output_shape(0) == (1, 7, 32)
    for u in (0, 1, 2):
        runner.forward(u, None)
    assert runner.kv_store.sequences() == {0} and runner.kv_store.bytes() > 0
    runner.backward(2, None)
    runner.backward(1, None)
    assert runner.kv_store.sequences() == {0}  # kept until the first slice finished backward
    runner.backward(0, None)
    assert len(runner.kv_store) == 0
    runner.forward(3, None)
    with pytest.raises(RuntimeError, match=r"units \[3\] ran forward but never backward"):
        runner.end_step()


def test_forward_only_matches_reference_loss_without_grads():
    model = tiny_model("qwen2", num_layers=NUM_LAYERS, seed=7)
    stages = build_stages(model, 2)
    batch = random_batch(LENGTHS, seed=7)
    ref_loss, _ = reference_loss_and_grads(model, batch)
    runners = [StageRunner(st) for st in stages]
    plan = make_plan(2)
    for r in runners:
        r.begin_step(plan, batch, label_token_count(batch))
    loss = 0.0
    for u in plan.units:
        h = runners[0].forward_only(u.id, None)
        assert not h.requires_grad
        loss += float(runners[1].forward_only(u.id, h))
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert all(len(r.kv_store) == 0 for r in runners)
    assert all(p.grad is None for st in stages for p in st.parameters())


def test_float32_runs_close_to_reference():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=8, dtype=torch.float32)
    stages = build_stages(model, 2)
    batch = random_batch(LENGTHS, seed=8)
    ref_loss, ref = reference_loss_and_grads(model, batch)
    loss = run_plan_locally(stages, make_plan(2), batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(collect_grads(stages, False), ref, rtol=1e-3, atol=1e-6)


def test_bfloat16_runs_and_keeps_dtype():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=9, dtype=torch.float64)
    stages = build_stages(model.to(torch.bfloat16), 2)
    batch = random_batch(LENGTHS, seed=9)
    ref_loss, _ = reference_loss_and_grads(tiny_model("llama", num_layers=NUM_LAYERS, seed=9), batch)
    loss = run_plan_locally(stages, make_plan(2), batch)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    grads = [p.grad for st in stages for p in st.parameters()]
    assert all(g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_stage_keeps_original_names_and_prunes():
    model = tiny_model("llama", num_layers=NUM_LAYERS)
    full = {n for n, _ in model.named_parameters()}
    stages = build_stages(model, 2)
    names = [{n for n, _ in st.named_parameters()} for st in stages]
    assert names[0] | names[1] == full and not names[0] & names[1]
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]
    assert "model.layers.3.mlp.up_proj.weight" in names[1]
    assert stages[0].hf_model.model.norm is None and stages[0].hf_model.lm_head is None
    assert stages[1].hf_model.model.rotary_emb is not None


def test_peft_lora_model_gradients():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=13)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    batch = random_batch(LENGTHS, seed=13)
    ref_loss, ref = reference_loss_and_grads(pm, batch)
    ref = {n.removeprefix("base_model.model."): g for n, g in ref.items()}
    assert any("lora_A" in n for n in ref) and not any("mlp" in n for n in ref)
    stages = build_stages(pm, 2)
    loss = run_plan_locally(stages, make_plan(2), batch)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    got = collect_grads(stages, False)
    assert set(got) == set(ref)
    assert_grads_close(got, ref)


def test_unsupported_model_is_a_clear_error():
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=64)
    gpt2 = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="model_type='gpt2'.*llama, mistral, qwen2, qwen3"):
        build_stage(gpt2, 0, range(0, 2))


def test_first_slice_backward_before_later_slice_is_an_error():
    model = tiny_model("llama", num_layers=NUM_LAYERS)
    stages = build_stages(model, 1)
    plan = make_plan(1, "gpipe")
    plan.actions[0][0] = [F(u.id) for u in plan.units] + [B(u.id) for u in plan.units]
    with pytest.raises(RuntimeError, match="sequence 0.*later slice"):
        run_plan_locally(stages, plan, random_batch(LENGTHS))


def test_bad_plan_order_is_an_error_not_a_hang():
    model = tiny_model("llama", num_layers=NUM_LAYERS)
    stages = build_stages(model, 2)
    plan = make_plan(2, "gpipe")
    plan.actions[0][1] = [B(0)] + [a for a in plan.actions[0][1] if str(a) != "B0"]
    with pytest.raises(ValueError, match="deadlocks"):
        run_plan_locally(stages, plan, random_batch(LENGTHS))
