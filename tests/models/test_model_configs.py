"""The shipped real-size configs parse for the planner and for transformers, with published sizes."""
import json

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import available_configs, config_path, load_config_dict

# Published parameter counts (model cards), in billions; a typo in a size field breaks these.
PUBLISHED_PARAMS_B = {
    "llama2-7b": 6.74, "llama2-13b": 13.0, "llama3-8b": 8.03, "llama3.1-8b": 8.03, "llama3.2-1b": 1.24,
    "qwen2.5-7b": 7.61, "smollm2-135m": 0.135, "llama-30b": 32.5, "llama2-70b": 69.0,
}


def test_all_expected_configs_are_shipped():
    assert set(PUBLISHED_PARAMS_B) <= set(available_configs())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_config_parses_for_planner_and_transformers(name):
    from transformers import AutoConfig

    spec = ModelSpec.from_json_file(config_path(name))
    cfg = AutoConfig.for_model(**load_config_dict(name))
    assert cfg.num_hidden_layers == spec.num_layers
    assert cfg.hidden_size == spec.hidden_size
    assert spec.num_attention_heads % spec.num_key_value_heads == 0
    assert spec.total_params / 1e9 == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.01)


def test_config_files_are_plain_hf_config_json():
    for name in available_configs():
        d = json.loads(config_path(name).read_text())
        assert d["architectures"] and d["model_type"] in ("llama", "qwen2")


def test_unknown_config_names_the_available_ones():
    with pytest.raises(ValueError, match="llama3-8b"):
        config_path("llama-9000")


def test_llama31_8b_has_its_real_128k_positions_and_rope_scaling():
    """Llama-3-8B's shipped config has 8K positions; 3.1's real config.json has 128K with llama3 RoPE
    scaling, and the planner keeps the positions (it warns on longer sequences)."""
    from transformers import AutoConfig

    d = load_config_dict("llama3.1-8b")
    assert d["max_position_embeddings"] == 131072 and d["rope_theta"] == 500000.0
    assert d["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert (d["bos_token_id"], d["eos_token_id"], d["torch_dtype"], d["tie_word_embeddings"]) == \
        (128000, 128001, "bfloat16", False)
    assert ModelSpec.from_json_file(config_path("llama3.1-8b")).max_position_embeddings == 131072
    assert ModelSpec.from_json_file(config_path("llama3-8b")).max_position_embeddings == 8192
    cfg = AutoConfig.for_model(**d)
    scaling = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None)
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
