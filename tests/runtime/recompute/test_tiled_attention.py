"""The tiled attention side (runtime/recompute/tiled_attention.py) against the untiled layer and the
unsplit HF model, float64.

A decoder layer whose token-wise parts run in tiles gives the same output and every gradient as
the layer as is, for every supported family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with
q/k norms), kept or replayed by a whole-layer checkpoint, with or without smaller MLP tiles
inside; what it saves outside the tiles' checkpoints is what the attention kernel needs (q, k, v,
its output: the planner's ``attention_tiled_elements`` less the layer input the tiles read), and
no projection ever sees more than a tile of tokens.  Whole plans with such units, at every
checkpoint level, equal the unsplit model.
"""
import pytest
import torch

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.cost.activations import attention_tiled_elements
from infinipipe_hf.runtime.recompute.tiled_attention import attention_tiles, tiled_layer_call, unsupported_reason
from infinipipe_hf.runtime.recompute.tiled_mlp import mlp_tiles
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, make_plan
from tests.helpers.reference import random_batch, tiny_model
from tests.runtime.offload.test_offload_levels import offloaded_bytes, run, with_mix

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _layer_and_input(family="llama", tokens=23, seed=60):
    model = tiny_model(family, num_layers=1, seed=seed)
    layer = model.model.layers[0]
    torch.manual_seed(seed + 1)
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(tokens)[None]
    cos_sin = model.model.rotary_emb(x, position_ids=pos)
    return model, layer, x, dict(attention_mask=None, position_ids=pos, position_embeddings=cos_sin)


def _out(h):
    return h[0] if isinstance(h, tuple) else h


def _grads(layer, x, call, kwargs, seed=61):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = _out(call(x, **kwargs))
    torch.manual_seed(seed)
    (out * torch.randn_like(out)).sum().backward()
    return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tile,mlp_tile", [(1, None), (5, None), (5, 3), (23, None), (64, 7)])
@pytest.mark.parametrize("ckpt", [False, True])
def test_tiled_layer_equals_the_layer(family, tile, mlp_tile, ckpt):
    _, layer, x, kw = _layer_and_input(family)
    assert unsupported_reason(layer) is None
    ref_out, ref_dx, ref = _grads(layer, x, layer, kw)
    call = tiled_layer_call(layer, mlp_tile, tile)
    if ckpt:  # a whole-layer checkpoint replays the tiled layer in backward
        def call(h, _c=call, **k):
            return torch.utils.checkpoint.checkpoint(_c, h, use_reentrant=False, **k)
    out, dx, got = _grads(layer, x, call, kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-10, atol=1e-12)
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)
    assert "forward" not in vars(layer) and "forward" not in vars(layer.mlp)  # restored


def _saved_bytes(call, x, kw, params):
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in params:
            seen[key] = key[1]
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _out(call(x, **kw))
    return out, sum(seen.values())


def test_a_tiled_layer_keeps_what_the_model_says():
    """Saved outside the tiles: the tiles' inputs (views of the layer input and of the attention
    output), q, k, v (the kernel's) and the kernel's per-row statistics; the rotary tables are the
    unit's, shared by its layers, and not counted (as parameters)."""
    tokens = 64
    model, layer, x, kw = _layer_and_input(tokens=tokens)
    cfg = model.config
    kv_dim = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    shared = [*layer.parameters(), *kw["position_embeddings"]]
    params = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in shared}
    _, whole = _saved_bytes(layer, x, kw, params)
    out, tiled = _saved_bytes(tiled_layer_call(layer, None, 8), x, kw, params)
    kernel = attention_tiled_elements(cfg.hidden_size, kv_dim) * tokens * 8
    kernel += cfg.hidden_size * tokens * 8  # HF's SDPA returns a contiguous copy beside the output it saves
    stats = cfg.num_attention_heads * tokens * 8 * 2  # at most two floats per query row and head
    assert kernel <= tiled <= kernel + stats, (tiled, kernel)
    assert tiled < whole / 3
    out.sum().backward()


def test_no_projection_sees_more_than_a_tile():
    _, layer, x, kw = _layer_and_input(tokens=23)
    seen = []
    for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        m.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[-2]))
    out = _out(tiled_layer_call(layer, None, 5)(x, **kw))
    out.sum().backward()
    # Forward tile by tile, then each tile's rerun in backward: q once per tile per pass, the post
    # tiles' o, gate, down likewise.
    assert max(seen) == 5 and len(seen) == 4 * 5 * 2


def test_blocks_restore_and_refuse():
    _, layer, x, kw = _layer_and_input()
    with attention_tiles(layer, 3), mlp_tiles(layer, 2):
        inner = vars(layer)["forward"]
        with attention_tiles(layer, 5):
            assert layer._epp_attention_tile_tokens == 5
        assert vars(layer)["forward"] == inner and layer._epp_attention_tile_tokens == 3
    assert "forward" not in vars(layer) and not hasattr(layer, "_epp_attention_tile_tokens")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="attention_tile_tokens must be a positive number"):
            tiled_layer_call(layer, None, bad)
    del layer.self_attn.o_proj
    assert "self_attn.o_proj" in unsupported_reason(layer)
    with pytest.raises(ValueError, match="cannot run in tiles.*self_attn.o_proj.*plan without attention_tile_tokens"):
        with attention_tiles(layer, 4):
            pass


MIXES = [CheckpointMix(), CheckpointMix(full=1), CheckpointMix(offload=1, full=1), CheckpointMix(offload=2),
         CheckpointMix(offload=1, keep_attn=1), CheckpointMix(mlp_act=2)]


@pytest.mark.parametrize("pp,family", [(1, "qwen2"), (2, "llama")])
def test_plans_with_tiled_attention_equal_the_model_at_every_level(pp, family):
    model = tiny_model(family, num_layers=NUM_LAYERS, seed=62)
    batch = random_batch(LENGTHS, seed=62, with_labels=True)
    plan = with_mix(make_plan(pp, "1f1b", "none"), lambda s, u, n: MIXES[(s + u) % len(MIXES)])
    plan.attention_tile_tokens = {u.id: 1 + u.id % 4 for u in plan.units if u.id % 3 != 2}
    plan.mlp_tile_tokens = {u.id: 2 for u in plan.units if u.id % 2}
    assert any(plan.checkpoint_mix(s, u).offload for s in range(pp) for u in plan.attention_tile_tokens)
    runners, _ = run(model, plan, batch)  # loss and every gradient against the unsplit model
    for r in runners:
        s = r.kv_store.host_tier.stats
        assert s.bytes_out == s.bytes_in == offloaded_bytes(plan, r.stage.stage_index) and s.current_bytes == 0


def test_plan_json_round_trip_keeps_the_tiles():
    plan = make_plan(2)
    assert "attention_tile_tokens" not in plan.to_dict()  # old plans load and write as before
    plan.attention_tile_tokens = {0: 4096, 3: 128}
    back = Plan.from_json(plan.to_json())
    assert back.attention_tile_tokens == {0: 4096, 3: 128} and back.to_dict() == plan.to_dict()
