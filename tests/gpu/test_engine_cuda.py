"""A short pp 1 training run of the engine on CUDA equals the unsplit HF model.

fp32 on CUDA (the attention falls back to exact SDPA) against the float64 CPU reference: loss and
every gradient, over three SGD steps with a plan that slices, packs and checkpoints.  bf16 with
the fused varlen/flash attention: loss within bf16 rounding of the reference.
"""
import copy

import pytest
import torch

from infinipipe_hf import InfiniPipeConfig, PipelineEngine
from infinipipe_hf.runtime.engine.planning import memory_budget_bytes
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [61, 23, 9, 5]
DEVICE = "cuda"  # a module constant so the test logic can be dry-run on CPU


def _engine(model, dtype, **kw):
    cfg = InfiniPipeConfig(pp_degree=1, num_slices=[3], loss_chunk_tokens=16, **kw)
    return PipelineEngine(copy.deepcopy(model).to(dtype), cfg, device=DEVICE)


@pytest.mark.parametrize("checkpointing", ["full", "none"])
def test_fp32_training_steps_match_unsplit_model(checkpointing):
    ref = tiny_model("llama", num_layers=3, tie=True, seed=5)
    engine = _engine(ref, torch.float32, checkpointing=checkpointing)
    plan, _ = engine.make_plan(LENGTHS)
    segments = [s for u in plan.units for s in u.segments]
    assert any(s.start > 0 for s in segments), "the plan must slice the longest sequence"
    assert any(len(u.segments) > 1 for u in plan.units), "the plan must pack short sequences"
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(list(engine.parameters()), lr=0.5)
    for step in range(3):
        batch = random_batch(LENGTHS, seed=step, with_labels=True)
        want_loss, want = reference_loss_and_grads(ref, batch)
        out = engine.train_step(batch, plan=plan)
        assert out.loss == pytest.approx(want_loss, rel=2e-5), f"step {step}"
        got = {n: p.grad.double().cpu() for n, p in engine.named_parameters()}
        assert_grads_close(got, want, rtol=2e-4, atol=1e-7)
        ref_opt.step()
        opt.step()
        ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)


def test_bf16_with_fused_attention_close_to_reference():
    ref = tiny_model("qwen2", num_layers=2, tie=False, seed=6, hidden=128, heads=4, kv_heads=2)
    batch = random_batch(LENGTHS, seed=9)
    want_loss, want = reference_loss_and_grads(ref, batch)
    engine = _engine(ref, torch.bfloat16, checkpointing="full", attention_backend="auto")
    out = engine.train_step(batch)
    assert out.loss == pytest.approx(want_loss, rel=2e-2)
    num = den = 0.0
    for n, p in engine.named_parameters():
        g, w = p.grad.double().cpu(), want[n]
        num += float((g - w).pow(2).sum())
        den += float(w.pow(2).sum())
    assert (num / den) ** 0.5 < 5e-2


def test_default_budget_holds_back_the_memory_margin():
    ref = tiny_model("llama", num_layers=2, tie=True, seed=5)
    engine = _engine(ref, torch.float32, memory_margin=0.1, memory_reserve_gib=1.0)
    total = torch.cuda.get_device_properties(engine.device).total_memory
    assert memory_budget_bytes(engine.config, engine.device) == pytest.approx(total * 0.9 - 2**30)
