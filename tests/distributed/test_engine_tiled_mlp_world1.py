"""The engine (world 1, pp 1, no process group) runs a plan whose units are whole sequences with
their MLP in tiles and every layer offloaded (ALST's plan in EPP's terms): the step equals the
unsplit float64 model, the layer inputs went through the host tier and came back, and the plan
passes the validator; a bad tile is refused before the step."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf import InfiniPipeConfig, PipelineEngine  # noqa: E402
from infinipipe_hf.planner.validate.validator import validate  # noqa: E402
from tests.distributed.plans import make_plan  # noqa: E402
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model  # noqa: E402

LENGTHS = [61, 23, 9]


def tiled_plan(layers_per_stage, tile=7):
    plan = make_plan(LENGTHS, [[[(i, 0, n)] for i, n in enumerate(LENGTHS)]], 1, layers_per_stage,
                     lambda s, u, n: 0)
    plan.checkpoint_levels = {0: {u.id: {"offload": layers_per_stage[0]} for u in plan.units}}
    plan.mlp_tile_tokens = {u.id: tile for u in plan.units}
    return plan


def test_whole_sequences_with_tiled_mlp_and_offloaded_layers_train_exactly():
    batch = random_batch(LENGTHS, seed=44, with_labels=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(host_memory_gib=1.0))
        plan = tiled_plan(engine.layers_per_stage)
        validate(plan, max_tokens_per_unit=max(LENGTHS))
        tokens = []
        for _, layer in engine.runner.stage.decoder_layers():
            layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: tokens.append(a[0].shape[-2]))
        out = engine.train_step(batch, plan=plan)
        want_loss, want = reference_loss_and_grads(tiny_model("llama"), batch)
    assert out.loss == pytest.approx(want_loss, rel=1e-10)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)
    stats = engine.host_tier.stats
    assert tokens and max(tokens) == 7  # every MLP call ran on one tile
    hidden = 32  # tiny_model's hidden size
    layers = engine.layers_per_stage[0]
    assert stats.bytes_out == stats.bytes_in == layers * sum(LENGTHS) * hidden * 8 and stats.current_bytes == 0


def test_a_bad_tile_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(host_memory_gib=1.0))
    plan = tiled_plan(engine.layers_per_stage, tile=0)
    with pytest.raises(ValueError, match="mlp_tile_tokens"):
        validate(plan, max_tokens_per_unit=max(LENGTHS))
    with pytest.raises(ValueError, match="mlp_tile_tokens"):
        engine.train_step(random_batch(LENGTHS, seed=45, with_labels=True), plan=plan)
