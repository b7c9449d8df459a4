"""``PipelineEngine`` without any process group (world 1, pp 1): planner injection, the default
planner, step outputs and user errors.  In-process and quick; the multi-process tiers are in
``test_exact_gradients.py`` and ``test_failures.py``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf import InfiniPipeConfig, PipelineEngine  # noqa: E402
from tests.distributed.plans import make_plan  # noqa: E402
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model  # noqa: E402

LENGTHS = [19, 7, 5]
UNITS = [[[(0, 0, 8)], [(0, 8, 19), (2, 0, 5)], [(1, 0, 7)]]]


def _reference(batch, tie=True):
    ref = tiny_model("qwen2", num_layers=2, tie=tie)
    ref.config._attn_implementation = "sdpa"  # eager softmax runs in float32
    return reference_loss_and_grads(ref, batch)


def test_injected_planner_exact_gradients_and_step_output():
    batch = random_batch(LENGTHS, with_labels=True)
    want_loss, want = _reference(batch)
    calls = []

    def planner(lengths, engine):
        calls.append(list(lengths))
        return make_plan(lengths, UNITS, 1, engine.layers_per_stage, lambda s, u, n: u % (n + 1))

    engine = PipelineEngine(tiny_model("qwen2", num_layers=2, tie=True), InfiniPipeConfig(),
                            planner=planner)
    assert engine.layout.world_size == 1 and engine.stage.is_first and engine.stage.is_last
    out = engine.train_step(batch)
    assert calls == [LENGTHS]
    assert out.loss == pytest.approx(want_loss, rel=1e-12)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)
    assert out.num_tokens == sum(LENGTHS)
    assert out.num_label_tokens == sum(sum(1 for t in b["labels"][1:] if t != -100) for b in batch)
    assert engine.last_plan is out.plan and out.simulation is None
    assert sorted(e.action for e in out.timeline.events) == sorted(
        f"{k}{u}" for k in "FB" for u in range(3))
    assert out.step_time_s > 0
    assert engine.eval_step(batch) == pytest.approx(want_loss, rel=1e-12)


def test_infeasible_planner_result_is_value_error():
    bad = SimpleNamespace(plan=None, feasible=False, error="needs 90 GiB, budget 80 GiB")
    engine = PipelineEngine(tiny_model("llama", num_layers=2), InfiniPipeConfig(),
                            planner=lambda lengths, engine: bad)
    with pytest.raises(ValueError, match="needs 90 GiB"):
        engine.train_step(random_batch(LENGTHS))


def test_plan_for_another_batch_and_bad_batches_are_value_errors():
    engine = PipelineEngine(tiny_model("llama", num_layers=2), InfiniPipeConfig())
    plan = make_plan(LENGTHS, UNITS, 1, engine.layers_per_stage)
    with pytest.raises(ValueError, match="plan the same batch"):
        engine.train_step(random_batch([19, 7, 6]), plan=plan)
    with pytest.raises(ValueError, match="non-empty list"):
        engine.train_step([], plan=plan)
    with pytest.raises(ValueError, match="must be 1-D"):
        engine.train_step([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}])
    with pytest.raises(ValueError, match="no label tokens"):
        engine.train_step([{"input_ids": [1, 2], "labels": [-100, -100]}])
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        engine.clip_grad_norm_(0.0)


def test_failed_step_keeps_accumulated_gradients(monkeypatch):
    engine = PipelineEngine(tiny_model("llama", num_layers=2), InfiniPipeConfig())
    plan = make_plan(LENGTHS, UNITS, 1, engine.layers_per_stage)
    batch = random_batch(LENGTHS)
    engine.train_step(batch, plan=plan)
    before = {n: p.grad.clone() for n, p in engine.named_parameters()}

    def broken_backward(unit_id, grad_out):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "backward", broken_backward)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.train_step(batch, plan=plan)
    for n, p in engine.named_parameters():
        assert torch.equal(p.grad, before[n]), n


def test_pp_without_process_group_is_value_error():
    with pytest.raises(ValueError, match="init_process_group"):
        PipelineEngine(tiny_model("llama", num_layers=2), InfiniPipeConfig(pp_degree=2))


def test_default_planner_exact_gradients():
    batch = random_batch(LENGTHS)
    want_loss, want = _reference(batch, tie=False)
    engine = PipelineEngine(tiny_model("qwen2", num_layers=2), InfiniPipeConfig(max_tokens_per_unit=8))
    out = engine.train_step(batch)
    assert out.simulation is not None and len(out.plan.units) >= 3
    assert out.loss == pytest.approx(want_loss, rel=1e-12)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)
