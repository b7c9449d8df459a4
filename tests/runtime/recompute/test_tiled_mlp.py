"""The tiled MLP (runtime/recompute/tiled_mlp.py) against the untiled layer and the unsplit HF
model, float64.

A decoder layer whose MLP runs in tiles gives the same output and every gradient as the layer
as is; the tensors it saves outside the tiles' checkpoints hold no MLP intermediate, and no
projection ever sees more than a tile of tokens (forward or backward), so the MLP's
intermediates exist one tile at a time.  Whole plans with tiled units, their layers at every
checkpoint level (``offload`` and ``full`` included), equal the unsplit model.
"""
import pytest
import torch

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.recompute.mlp_levels import install_mlp_levels, mlp_level
from infinipipe_hf.runtime.recompute.tiled_mlp import check_tile_tokens, mlp_tiles, tiled_call
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, check, make_plan
from tests.helpers.reference import random_batch, tiny_model
from tests.runtime.offload.test_offload_levels import offloaded_bytes, run, with_mix


def _layer_and_input(tokens=23, seed=40):
    model = tiny_model("llama", num_layers=1, seed=seed)
    layer = model.model.layers[0]
    torch.manual_seed(seed + 1)
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(tokens)[None]
    cos_sin = model.model.rotary_emb(x, position_ids=pos)
    return model, layer, x, dict(attention_mask=None, position_ids=pos, position_embeddings=cos_sin)


def _out(h):
    return h[0] if isinstance(h, tuple) else h


def _grads(layer, x, call, kwargs, seed=41):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = _out(call(x, **kwargs))
    torch.manual_seed(seed)
    (out * torch.randn_like(out)).sum().backward()
    return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("tile", [1, 5, 23, 64])
@pytest.mark.parametrize("ckpt", [False, True])
def test_tiled_layer_equals_the_layer(tile, ckpt):
    _, layer, x, kw = _layer_and_input()
    ref_out, ref_dx, ref = _grads(layer, x, layer, kw)
    call = tiled_call(layer, tile)
    if ckpt:  # a whole-layer checkpoint replays the tiled layer in backward
        def call(h, _c=call, **k):
            return torch.utils.checkpoint.checkpoint(_c, h, use_reentrant=False, **k)
    out, dx, got = _grads(layer, x, call, kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-10, atol=1e-12)
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)
    assert "forward" not in vars(layer.mlp)  # restored


def test_only_one_tile_of_intermediates_at_a_time():
    model, layer, x, kw = _layer_and_input(tokens=23)
    inter, tile = model.config.intermediate_size, 5
    seen = {"saved": [], "tokens": []}
    layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: seen["tokens"].append(a[0].shape[-2]))

    def pack(t):
        seen["saved"].append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _out(layer(x, **kw))
    assert any(s[-1] == inter for s in seen["saved"])  # untiled: the intermediates are saved
    seen["saved"].clear()
    seen["tokens"].clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _out(tiled_call(layer, tile)(x, **kw))
    assert not any(s and s[-1] == inter for s in seen["saved"]), seen["saved"]
    out.sum().backward()
    # Forward tile by tile, then each tile's rerun in backward, last tile first.
    assert seen["tokens"] == [5, 5, 5, 5, 3] + [3, 5, 5, 5, 5]


def test_tiles_override_the_mlp_levels_and_restore_them():
    _, layer, x, kw = _layer_and_input()
    assert install_mlp_levels(layer)
    leveled = vars(layer.mlp)["forward"]
    ref_out, ref_dx, _ = _grads(layer, x, layer, kw)
    with mlp_level(layer, "mlp_act"):
        out, dx, _ = _grads(layer, x, tiled_call(layer, 4), kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-10, atol=1e-12)
    assert vars(layer.mlp)["forward"] == leveled
    with mlp_tiles(layer, 3):
        inner = vars(layer.mlp)["forward"]
        with mlp_tiles(layer, 5):
            pass
        assert vars(layer.mlp)["forward"] == inner and layer.mlp._epp_mlp_tile_tokens == 3
    assert vars(layer.mlp)["forward"] == leveled and not hasattr(layer.mlp, "_epp_mlp_tile_tokens")


def test_bad_tiles_and_unswitchable_mlps_are_errors():
    for bad in (0, -3, 2.5, True, None.__class__):
        with pytest.raises(ValueError, match="positive number of tokens"):
            check_tile_tokens(bad)
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no gated MLP"):
        with mlp_tiles(layer, 4):
            pass


MIXES = [CheckpointMix(), CheckpointMix(full=1), CheckpointMix(offload=1, full=1), CheckpointMix(mlp=1),
         CheckpointMix(offload=1, keep_attn=1), CheckpointMix(mlp_act=2), CheckpointMix(offload=2)]


@pytest.mark.parametrize("pp,dp", [(1, 1), (2, 1), (1, 2)])
def test_plans_with_tiled_units_equal_the_model_at_every_level(pp, dp):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=42)
    lengths = LENGTHS * dp
    batch = random_batch(lengths, seed=42, with_labels=True)
    plan = with_mix(make_plan(pp, "1f1b", "none", dp=dp, lengths=lengths), lambda s, u, n: MIXES[(s + u) % len(MIXES)])
    plan.mlp_tile_tokens = {u.id: 1 + u.id % 4 for u in plan.units if u.id % 3 != 2}
    assert any(plan.checkpoint_mix(s, u).offload for s in range(pp) for u in plan.mlp_tile_tokens)
    runners, _ = run(model, plan, batch)
    for r in runners:
        s = r.kv_store.host_tier.stats
        assert s.bytes_out == s.bytes_in == offloaded_bytes(plan, r.stage.stage_index) and s.current_bytes == 0


def test_one_tiled_unit_per_sequence_every_layer_offloaded():
    """ALST's plan in EPP's terms: each sequence one unit (no K/V carried), every layer offloaded,
    the MLP in tiles."""
    model = tiny_model("qwen2", num_layers=NUM_LAYERS, seed=43)
    lengths = [29, 11]
    batch = random_batch(lengths, seed=43)
    units = [Unit(i, (Segment(i, 0, n),)) for i, n in enumerate(lengths)]
    plan = Plan("test", 1, 1, lengths, units, {0: [[F(0), B(0), F(1), B(1)]]}, {}, layers_per_stage=[NUM_LAYERS])
    plan = with_mix(plan, lambda s, u, n: CheckpointMix(offload=n))
    plan.mlp_tile_tokens = {u.id: 6 for u in plan.units}
    run(model, plan, batch)
    plan.checkpoint_levels.clear()
    plan.checkpoint_layers = {0: {u.id: NUM_LAYERS for u in plan.units}}
    check(model, build_stages(model, 1), plan, batch)


def test_plan_json_round_trip_keeps_the_tiles():
    plan = make_plan(2)
    assert "mlp_tile_tokens" not in plan.to_dict()
    plan.mlp_tile_tokens = {0: 4096, 3: 128}
    back = Plan.from_json(plan.to_json())
    assert back.mlp_tile_tokens == {0: 4096, 3: 128} and back.to_dict() == plan.to_dict()


@pytest.mark.parametrize("ckpt", [False, True])
def test_tiles_rerun_what_the_planner_prices(ckpt):
    """The projections' forward GEMMs (planner/cost/levels.py ``tiled_mlp_recompute_s``): a kept
    layer's tiles rerun gate and up, never down_proj; a whole-layer replay runs the tiles' forward,
    down_proj included, up to the last tile's input, then every tile reruns gate and up."""
    from tests.runtime.recompute.test_recompute_levels import ForwardGemms

    _, layer, x, kw = _layer_and_input(tokens=23)
    weights = {p: getattr(layer.mlp, p).weight for p in ("gate_proj", "up_proj", "down_proj")}
    call = tiled_call(layer, 5)
    with ForwardGemms(weights) as gemms:
        out = _out(torch.utils.checkpoint.checkpoint(call, x, use_reentrant=False, **kw) if ckpt else call(x, **kw))
        assert gemms.count == {"gate_proj": 5, "up_proj": 5, "down_proj": 5}
        out.sum().backward()
    replay = 4 if ckpt else 0
    assert gemms.count == {"gate_proj": 10 + replay, "up_proj": 10 + replay, "down_proj": 5 + replay}
