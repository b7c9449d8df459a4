"""Per-layer compile (``compile_layers``) against eager and the unsplit HF model, float64, inductor on CPU.

HF's RMSNorm computes in float32 even for a float64 model, and inductor fuses that float32
reduction in another order than eager, which alone moves float64 gradients by ~1e-8; the tests
therefore give the norm classes a float64-faithful forward (the same math without the float32
round trip) for both the reference and the compiled run, so any difference left is the compiled
layer's and the 1e-10 bound of the other runtime tests holds.

Compile on 2 shared CPU cores is slow: tiny models (1-2 layers, hidden 32); the inductor cache
on disk makes reruns fast.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from infinipipe_hf import InfiniPipeConfig, PipelineEngine
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.stage.compile import EPP_COMPILED, compile_stage_layers, is_compiled
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers import local_pipeline as lp
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model


def _float64_rms_norm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def model_factory(monkeypatch):
    """``tiny_model`` with float64-faithful RMSNorms (see the module docstring); dynamo reset."""
    torch._dynamo.reset()
    counters.clear()

    def make(family="llama", num_layers=2, **kw):
        model = tiny_model(family, num_layers=num_layers, **kw)
        for cls in {type(m) for m in model.modules() if type(m).__name__.endswith("RMSNorm")}:
            monkeypatch.setattr(cls, "forward", _float64_rms_norm)
        return model

    yield make
    torch._dynamo.reset()


def _run_actions(runner, plan, batch, after_first=None):
    runner.begin_step(plan, batch, label_token_count(batch))
    loss = 0.0
    for i, a in enumerate(plan.stage_actions(0, 0)):
        if a.is_forward:
            loss += float(runner.forward(a.unit, None))
        else:
            runner.backward(a.unit, None)
        if i == 0 and after_first is not None:
            after_first()
    runner.end_step()
    return loss


def _other_sizes_plan(lengths):
    """Units of 13, 10+5, 12+8 and 2 tokens (none of the sizes of ``lp.make_plan``)."""
    segs = [[(0, 0, 13)], [(0, 13, 23), (1, 0, 5)], [(2, 0, 12), (3, 0, 8)], [(4, 0, 2)]]
    units = [Unit(i, tuple(Segment(*s) for s in sg)) for i, sg in enumerate(segs)]
    actions = {0: lp.gpipe(units, None, 1)}
    return Plan("test", 1, 1, list(lengths), units, actions, {0: {u.id: 0 for u in units}},
                layers_per_stage=[2])


def _one_stage(model, monkeypatch, num_layers):
    monkeypatch.setattr(lp, "NUM_LAYERS", num_layers)
    (stage,) = lp.build_stages(model, 1)
    return stage


def test_compiled_stage_exact_and_one_graph_for_every_unit_size(model_factory, monkeypatch):
    model = model_factory(num_layers=2)
    stage = _one_stage(model, monkeypatch, 2)
    assert compile_stage_layers(stage) == 2 and compile_stage_layers(stage) == 0  # once
    assert stage.config._attn_implementation == EPP_COMPILED
    assert all(is_compiled(layer) for _, layer in stage.decoder_layers())
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in model.named_parameters()]
    runner = StageRunner(stage, loss_chunk_tokens=5)
    seen = {}
    # Units of 7, 11, 11+6, 9+4 and 3 tokens: slices with carried K/V, a hybrid and packs.
    plan, batch = lp.make_plan(1, ckpt="none"), random_batch(lp.LENGTHS, with_labels=True)
    loss = _run_actions(runner, plan, batch,
                        after_first=lambda: seen.update(first=counters["frames"]["total"]))
    ref_loss, ref = reference_loss_and_grads(model, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert_grads_close(lp.collect_grads([stage], False), ref, rtol=1e-10)
    # The first unit's first layer compiled every graph; the second layer and the other sizes
    # reused them, and so does a step whose units all have new sizes.
    assert seen["first"] > 0 and counters["frames"]["total"] == seen["first"]
    assert counters["recompiles"] == {} or not any(counters["recompiles"].values())
    lengths = [23, 5, 12, 8, 2]
    stage.zero_grad(set_to_none=True)
    batch2 = random_batch(lengths, seed=3, with_labels=True)
    loss2 = _run_actions(runner, _other_sizes_plan(lengths), batch2)
    assert counters["frames"]["total"] == seen["first"]
    ref_loss2, ref2 = reference_loss_and_grads(model, batch2)
    assert loss2 == pytest.approx(ref_loss2, rel=1e-12)
    assert_grads_close(lp.collect_grads([stage], False), ref2, rtol=1e-10)


@pytest.mark.parametrize("tiles", [None, 4])
def test_compiled_stage_with_checkpoint_levels_and_tiles(model_factory, monkeypatch, tiles):
    """Whole-layer, keep_attn, mlp and mlp_act checkpoints around and inside the compiled layers,
    and (``tiles``) MLP tiles, which run the layer eagerly: exact against HF."""
    model = model_factory(num_layers=2, seed=1)
    stage = _one_stage(model, monkeypatch, 2)
    compile_stage_layers(stage)
    plan = lp.with_levels(lp.make_plan(1, ckpt="some"), lp.MIX_CYCLE)
    assert plan.checkpoint_levels and any(plan.checkpoint_layers[0].values())
    if tiles:
        plan.mlp_tile_tokens = {u.id: tiles for u in plan.units}
    batch = random_batch(lp.LENGTHS, seed=1, with_labels=True)
    loss = _run_actions(StageRunner(stage, loss_chunk_tokens=5), plan, batch)
    ref_loss, ref = reference_loss_and_grads(model, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert_grads_close(lp.collect_grads([stage], False), ref, rtol=1e-10)
    # Tiled layers run eagerly (nothing compiled); the others compiled.
    assert (counters["frames"]["total"] == 0) == bool(tiles)


def test_engine_compiled_with_its_planner_offload_and_levels_matches_hf(model_factory):
    """``InfiniPipeConfig(compile_layers=True)`` through ``PipelineEngine`` and its own planner,
    under a budget that makes it offload a layer input and use keep_attn / mlp levels on units of
    nine sizes: the step equals single-process HF."""
    from tests.distributed.test_engine_offload_world1 import BUDGETS_GIB, LENGTHS, offloaded

    batch = random_batch(LENGTHS, seed=41, with_labels=True)
    want_loss, want = reference_loss_and_grads(model_factory(num_layers=4), batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for gib in BUDGETS_GIB:
            cfg = InfiniPipeConfig(max_tokens_per_unit=256, memory_budget_gib=gib, host_memory_gib=1.0,
                                   compile_layers=True)
            engine = PipelineEngine(model_factory(num_layers=4), cfg)
            plan = _plan_or_none(engine, LENGTHS)
            if plan is not None and offloaded(plan):
                break
    assert plan is not None and offloaded(plan), f"no budget in {BUDGETS_GIB} GiB made the planner offload"
    levels = {lv for per in plan.checkpoint_levels[0].values() for lv in per}
    assert {"offload", "keep_attn"} <= levels, levels
    assert all(is_compiled(layer) for _, layer in engine.stage.decoder_layers())
    out = engine.train_step(batch, plan=plan)
    assert out.loss == pytest.approx(want_loss, rel=1e-12)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)


def _plan_or_none(engine, lengths):
    try:
        return engine.make_plan(lengths)[0]
    except ValueError:  # infeasible at this budget
        return None


def test_profiler_times_the_compiled_layer_with_one_graph_for_every_length(model_factory, monkeypatch):
    """``python -m infinipipe_hf.profile --compile``: the profiled layer is compiled as a stage's
    (attention behind the same break), equals the eager layer, and every length reuses its graphs."""
    from infinipipe_hf.profiling.measure import measure_layer
    from infinipipe_hf.profiling.modules import build_modules, decoder_classes
    from infinipipe_hf.runtime.stage.compile import compile_profiled_layer

    monkeypatch.setattr(decoder_classes("llama")[2], "forward", _float64_rms_norm)
    tiny = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 72, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
            "max_position_embeddings": 4096}
    m = build_modules(tiny, torch.device("cpu"), torch.float64)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    pe = m.rotary(x, torch.arange(12).unsqueeze(0))
    want = m.layer(x, attention_mask=None, position_embeddings=pe)
    compile_profiled_layer(m.layer, m.config)
    assert m.config._attn_implementation == "sdpa_compiled" and is_compiled(m.layer)
    got = m.layer(x, attention_mask=None, position_embeddings=pe)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    rows = [measure_layer(m, 16, torch.device("cpu"), torch.float64, warmup=1, repeat=1)]
    frames = counters["frames"]["total"]
    rows.append(measure_layer(m, 40, torch.device("cpu"), torch.float64, warmup=1, repeat=1))
    assert frames > 0 and counters["frames"]["total"] == frames  # a new length: no new graph
    assert all(r["fwd_bwd_ms"] > 0 for r in rows)
