"""State bytes per rank (``planner/cost/states.py``): the precision presets, and the cost model
counting the same states (checked against a real model's parameters in
``tests/runtime/test_model_states_vs_torch.py``)."""
import dataclasses

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.cost.states import BF16_MIXED_ADAM, FP32_ADAM, StatePrecision, stage_state_bytes_per_rank

# Odd sizes, as in the check against the real model.
CONFIG = dict(vocab_size=101, hidden_size=36, intermediate_size=75, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False)


def test_precision_presets_and_profile():
    assert FP32_ADAM.state_bytes_per_param == BF16_MIXED_ADAM.state_bytes_per_param == 16
    assert (FP32_ADAM.compute_bytes_per_param, BF16_MIXED_ADAM.compute_bytes_per_param) == (4, 2)
    p = dataclasses.replace(default_profile(), state_bytes_per_param=12.0)
    assert StatePrecision.from_profile(p) == StatePrecision(12.0, 4.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="grad_bytes_per_param"):
        StatePrecision(state_bytes_per_param=2.0)


def test_cost_model_uses_the_same_states():
    spec = ModelSpec.from_config_dict({**CONFIG, "model_type": "llama"})
    for shard in ("none", "sp"):
        c = CostModel(spec, dims=ParallelDims(pp_degree=2, sp_degree=2, shard=shard), state_precision=FP32_ADAM)
        for s in range(2):
            want = stage_state_bytes_per_rank(spec, c.layers_per_stage[s], embedding=s == 0, head=s == 1,
                                              shard_degree=2 if shard == "sp" else 1)
            assert c.states.state_bytes_per_rank(s) == want
    assert CostModel(spec, dims=ParallelDims(pp_degree=2)).acts.static_bytes(0) == stage_state_bytes_per_rank(
        spec, CostModel(spec, dims=ParallelDims(pp_degree=2)).layers_per_stage[0], embedding=True, head=False,
        precision=StatePrecision.from_profile(default_profile()))
