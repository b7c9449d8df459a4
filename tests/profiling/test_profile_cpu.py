"""The profiler's CPU smoke mode, its probes and its user errors (the GPU numbers need a GPU)."""
import json

import pytest
import torch

from infinipipe_hf import profile as prof
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.activations import _act_elements
from infinipipe_hf.planner.cost.profile import HardwareProfile
from infinipipe_hf.profiling.timer import saved_bytes, time_fn

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 211,
        "max_position_embeddings": 4096}


def test_cpu_smoke_profile_is_loadable_and_saved_bytes_match_the_layer(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "profile.json"
    rc = prof.main(["--model", str(cfg), "--out", str(out), "--device", "cpu", "--dtype", "fp32",
                    "--lengths", "32,64,128", "--head-tokens", "32,64", "--slice-attention", "16:32",
                    "--warmup", "0", "--repeat", "1"])
    assert rc == 0
    p = HardwareProfile.load(out)
    assert p.bytes_per_element == 4 and p.reference["hidden_size"] == 64
    rows = json.loads(out.with_suffix(".rows.json").read_text())
    kinds = [r["kind"] for r in rows["rows"]]
    assert kinds.count("layer_causal") == 3 and kinds.count("lm_head_ce") == 2
    assert kinds.count("attn_slice_lower_right") == 1
    # The mlp_act checkpoint level's recompute: measured bandwidth, carried into the profile.
    (act,) = [r for r in rows["rows"] if r["kind"] == "mlp_act_recompute"]
    assert act["bytes_per_s"] > 0 and p.elementwise_bytes_per_s == act["bytes_per_s"]
    assert rows["env"]["torch"] == torch.__version__ and rows["reference"]["vocab_size"] == 211
    # The host tier: the CPU AdamW step measured (fused and foreach), carried into the profile;
    # pinned copies need CUDA, so the bandwidth keeps its default and the rows file says why.
    adamw = {r["impl"]: r for r in rows["rows"] if r["kind"] == "host_adamw"}
    assert set(adamw) == {"fused", "foreach"} and all(r["params_per_s"] > 0 and r["threads"] >= 1
                                                      for r in adamw.values())
    assert p.host_optimizer_params_per_s == adamw["fused"]["params_per_s"]
    assert "host_copy" not in kinds and p.host_bandwidth_bytes_per_s == HardwareProfile.host_bandwidth_bytes_per_s
    assert any("host_copy" in note for note in rows["notes"])
    # The rows file is itself a profile (fitted on load), equal to the written fit.
    assert HardwareProfile.load(out.with_suffix(".rows.json")).layer_forward == p.layer_forward
    # Saved activations of a Llama layer: the cost model's element count, within 15%.
    expect = _act_elements(ModelSpec.from_config_dict(TINY)) * 4
    assert abs(p.activation_bytes_per_token_per_layer - expect) / expect < 0.15
    for r in rows["rows"]:
        assert r.get("fwd_bwd_ms", r.get("ms")) > 0


def test_no_cuda_is_a_clear_error(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert prof.main(["--model", str(cfg), "--out", str(tmp_path / "p.json")]) == 2
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--lengths", "64,x"], "comma-separated integers"),
    (["--lengths", "64,128"], ">= 3 --lengths"),
    (["--slice-attention", "16-32"], "SLICE:PREFIX"),
])
def test_bad_arguments(tmp_path, capsys, argv, match):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    rc = prof.main(["--model", str(cfg), "--out", str(tmp_path / "p.json"), "--device", "cpu", *argv])
    assert rc == 2 and match in capsys.readouterr().err


def test_unsupported_model_type_names_supported_ones(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "model_type": "gpt2"}))
    assert prof.main(["--model", str(cfg), "--out", str(tmp_path / "p.json"), "--device", "cpu"]) == 2
    assert "llama" in capsys.readouterr().err


def test_saved_bytes_counts_activations_not_parameters():
    w = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(5, 8, requires_grad=True)
    # x @ w saves x (5*8 floats) and w (excluded); relu saves its output (5*16 floats).
    n = saved_bytes(lambda: torch.relu(x @ w), exclude=[w])
    assert n == (5 * 8 + 5 * 16) * 4


def test_time_fn_median_and_arguments():
    calls = []
    assert time_fn(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeat=3) >= 0
    assert len(calls) == 5
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        time_fn(lambda: None, torch.device("cpu"), repeat=0)
