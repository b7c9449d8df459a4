"""Cost model and hardware profile: fit quality on the shipped H100 measurements, scaling, memory."""
import json
from pathlib import Path

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec, UnsupportedModelError
from infinipipe_hf.ir.partition import balanced_layer_split
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile, uncalibrated_profile

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def _layer_rows():
    prof = json.loads((Path(__file__).parents[3] / "infinipipe_hf/profiles/h100_bf16_measurements.json").read_text())
    return [r for r in prof["rows"] if r["kind"] == "layer_causal"]


def test_default_profile_fits_measurements_within_15_percent():
    # The layer fit alone: the shipped default divides it by EPP's whole-step efficiency.
    cm = CostModel(ModelSpec.from_config_dict(LLAMA3_8B), uncalibrated_profile())
    for row in _layer_rows():
        s = row["tokens"]
        shape = UnitShape.of([Segment(0, 0, s)])
        got = cm.coefficients.layer_fwd(shape.pairs, s) + cm.coefficients.layer_bwd(shape.pairs, s)
        want = row["fwd_bwd_ms"] / 1e3
        assert abs(got / want - 1) < 0.15, (s, got, want)


def test_small_slices_cost_more_per_token():
    cm = CostModel(ModelSpec.from_config_dict(LLAMA3_8B))
    per_token = [cm.coefficients.layer_fwd(s * s, s) / s for s in (512, 2048, 8192)]
    assert per_token[0] > per_token[1]


def test_band_term_makes_later_slices_dearer():
    cm = CostModel(ModelSpec.from_config_dict(LLAMA3_8B))
    first = UnitShape.of([Segment(0, 0, 8192)])
    later = UnitShape.of([Segment(0, 65536, 65536 + 8192)])
    assert later.pairs == 8192**2 + 2 * 65536 * 8192
    assert cm.coefficients.layer_fwd(later.pairs, later.tokens) > 2 * cm.coefficients.layer_fwd(first.pairs, first.tokens)


def test_scaling_is_flop_proportional():
    small = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=7168, num_attention_heads=16)
    big = CostModel(ModelSpec.from_config_dict(LLAMA3_8B))
    little = CostModel(ModelSpec.from_config_dict(small))
    flops = little.spec.layer_linear_flops_per_token() / big.spec.layer_linear_flops_per_token()
    assert 0.2 < flops < 0.3
    assert little.coefficients.layer_fwd.token_s == pytest.approx(big.coefficients.layer_fwd.token_s * flops)
    assert little.coefficients.layer_fwd.attn_pair_s == pytest.approx(big.coefficients.layer_fwd.attn_pair_s / 2)


def test_memory_terms():
    spec = ModelSpec.from_config_dict(LLAMA3_8B)
    cm = CostModel(spec, dims=ParallelDims(pp_degree=4), memory_budget_bytes=80 * 2**30)
    assert sum(cm.layers_per_stage) == 32 and cm.layers_per_stage[-1] < cm.layers_per_stage[0]  # head costs ~2 layers
    full = cm.acts.activation_bytes(1, 1000, 0)
    ckpt = cm.acts.activation_bytes(1, 1000, 3)
    assert full - ckpt == pytest.approx(3 * cm.acts.activation_bytes_per_checkpointed_layer(1, 1000))
    assert cm.acts.activation_bytes(1, 1000, 0) == pytest.approx(1000 * cm.layers_per_stage[1] * default_profile().activation_bytes_per_token_per_layer, rel=0.01)
    with pytest.raises(AssertionError):
        cm.acts.activation_bytes(1, 1000, cm.layers_per_stage[1] + 1)
    # first stage holds the embedding, last the head
    layer_states = spec.layer_params * 16
    assert cm.acts.static_bytes(1) == cm.layers_per_stage[1] * layer_states
    assert cm.acts.static_bytes(0) == cm.layers_per_stage[0] * layer_states + spec.embedding_params * 16
    assert cm.acts.static_bytes(3) == cm.layers_per_stage[3] * layer_states + (spec.embedding_params + spec.hidden_size) * 16


def test_profile_round_trip(tmp_path):
    p = default_profile()
    path = tmp_path / "p.json"
    p.save(path)
    assert HardwareProfile.load(path) == p
    with pytest.raises(ValueError, match="does not exist"):
        HardwareProfile.load(tmp_path / "missing.json")


def test_balanced_split():
    assert balanced_layer_split(32, 4) == [8, 8, 8, 8]
    split = balanced_layer_split(10, 3, 0.0, 2.0)
    assert sum(split) == 10 and split[-1] < split[0]
    with pytest.raises(ValueError, match="pp_degree=8 exceeds the model's 4 decoder layers"):
        balanced_layer_split(4, 8)


def test_bad_layer_split_rejected():
    with pytest.raises(ValueError, match="layers_per_stage"):
        CostModel(ModelSpec.from_config_dict(LLAMA3_8B), dims=ParallelDims(pp_degree=2), layers_per_stage=[30, 1])


def test_unsupported_architecture():
    with pytest.raises(UnsupportedModelError, match="gpt2.*not supported.*llama"):
        ModelSpec.from_config_dict(dict(LLAMA3_8B, model_type="gpt2"))


@pytest.mark.parametrize("pp", [1, 4, 8])
def test_slowest_stage_time_equals_per_stage_max(pp):
    import random

    from infinipipe_hf.planner.cost.compute import UnitShape

    spec = ModelSpec("llama", 40, 5120, 13824, 40, 40, 128, 32000, False)
    cost = CostModel(spec, dims=ParallelDims(pp_degree=pp))
    rng = random.Random(pp)
    for _ in range(500):
        t = rng.randint(1, 60000)
        shape = UnitShape(float(rng.randint(t, t * t)), t)
        want = max(cost.compute.forward_time(s, shape) + cost.backward_time(s, shape, 0) for s in range(pp))
        assert cost.compute.slowest_stage_time(shape) == want  # bit-identical, not approximately
