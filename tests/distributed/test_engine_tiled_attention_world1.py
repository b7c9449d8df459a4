"""The engine (world 1, pp 1, no process group) runs a plan whose units are whole sequences with
their attention side in tiles (``attention_tile_tokens``) and their layers offloaded (host tier),
checkpointed or kept: the step equals the unsplit float64 model, the offloaded layer inputs went
through the host tier and came back, no projection saw more than a tile, and the plan passes the
validator; a bad tile is refused before the step."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf import InfiniPipeConfig, PipelineEngine  # noqa: E402
from infinipipe_hf.planner.validate.validator import validate  # noqa: E402
from tests.distributed.plans import make_plan  # noqa: E402
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model  # noqa: E402

LENGTHS = [61, 23, 9]
LEVELS = ({"offload": 2}, {"offload": 1}, {})
"""Per unit, beside ``CHECKPOINTED``: two layers offloaded; one offloaded and one checkpointed;
one checkpointed, the rest kept."""
CHECKPOINTED = (0, 1, 1)


def tiled_plan(layers_per_stage, tile=7, mlp_tile=None):
    plan = make_plan(LENGTHS, [[[(i, 0, n)] for i, n in enumerate(LENGTHS)]], 1, layers_per_stage,
                     lambda s, u, n: CHECKPOINTED[u])
    plan.checkpoint_levels = {0: {u.id: dict(LEVELS[u.id]) for u in plan.units if LEVELS[u.id]}}
    plan.attention_tile_tokens = {u.id: tile for u in plan.units}
    if mlp_tile:
        plan.mlp_tile_tokens = {u.id: mlp_tile for u in plan.units}
    return plan


@pytest.mark.parametrize("family,mlp_tile", [("llama", None), ("qwen2", 3)])
def test_whole_sequences_with_tiled_attention_train_exactly(family, mlp_tile):
    batch = random_batch(LENGTHS, seed=46, with_labels=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PipelineEngine(tiny_model(family), InfiniPipeConfig(host_memory_gib=1.0))
        plan = tiled_plan(engine.layers_per_stage, mlp_tile=mlp_tile)
        validate(plan, max_tokens_per_unit=max(LENGTHS))
        tokens = []
        for _, layer in engine.runner.stage.decoder_layers():
            for m in (layer.self_attn.q_proj, layer.self_attn.o_proj):
                m.register_forward_pre_hook(lambda m, a: tokens.append(a[0].shape[-2]))
        out = engine.train_step(batch, plan=plan)
        want_loss, want = reference_loss_and_grads(tiny_model(family), batch)
    assert out.loss == pytest.approx(want_loss, rel=1e-10)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)
    assert tokens and max(tokens) == 7  # every projection ran on one tile
    stats = engine.host_tier.stats
    hidden = 32  # tiny_model's hidden size
    offloaded = sum(lv.get("offload", 0) * n for lv, n in zip(LEVELS, LENGTHS))
    assert stats.bytes_out == stats.bytes_in == offloaded * hidden * 8 and stats.current_bytes == 0


def test_a_bad_tile_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(host_memory_gib=1.0))
    plan = tiled_plan(engine.layers_per_stage, tile=0)
    with pytest.raises(ValueError, match="attention_tile_tokens"):
        validate(plan, max_tokens_per_unit=max(LENGTHS))
    with pytest.raises(ValueError, match="attention_tile_tokens"):
        engine.train_step(random_batch(LENGTHS, seed=47, with_labels=True), plan=plan)
