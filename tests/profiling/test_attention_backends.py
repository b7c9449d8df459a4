"""The attention-backend table on CPU, end to end: measured, written into the profile, read back,
and routed by; on CPU FlexAttention runs forward only (its backward waits for a GPU)."""
import json
from dataclasses import replace

import pytest
import torch

from infinipipe_hf import profile as prof
from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.profiling.attention_backends import attention_table, kind_problem, kind_segments, rank
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import select_backend
from infinipipe_hf.runtime.attention.types import UNIT_KINDS, unit_kind
from infinipipe_hf.runtime.engine import planning

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 211,
        "max_position_embeddings": 4096}


@pytest.mark.parametrize("tokens", [16, 100, 2048])
def test_representative_problems_have_their_kind_and_token_count(tokens):
    for kind in UNIT_KINDS:
        lengths, contexts = kind_segments(kind, tokens)
        assert sum(lengths) == tokens and len(lengths) == len(contexts)
        a = kind_problem(kind, tokens, 4, 2, 8, "cpu", torch.float32, requires_grad=False)
        assert unit_kind(a) == kind and a.query.shape == (1, 4, tokens, 8)
    assert kind_segments("packed", 16) == ([2] * 8, [0] * 8)
    assert kind_segments("slice", 16) == ([16], [16])
    assert kind_segments("hybrid", 16) == ([8, 2, 2, 2, 2], [8, 0, 0, 0, 0])
    assert kind_segments("packed", 16384) == ([1024] * 16, [0] * 16)  # the pack of 16 x 1K
    with pytest.raises(ValueError, match="unit kind must be one of"):
        kind_segments("pack", 16)


def test_cpu_table_measures_flex_forward_only():
    table = attention_table(4, 2, 8, "cpu", torch.float32, tokens=(16, 32), warmup=0, repeat=1)
    assert table["tokens"] == [16, 32] and table["forward_only"] == ["flex"] and table["not_measured"] == []
    for kind in UNIT_KINDS:
        assert all(s > 0 for s in table["forward_s"][kind]["flex"] + table["forward_s"][kind]["sdpa"])
        assert table["forward_backward_s"][kind]["flex"] is None  # no CPU backward: not measured, not ranked
        assert all(s > 0 for s in table["forward_backward_s"][kind]["sdpa"])
        assert table["ranking"][kind] == ["sdpa"] and table["fastest"][kind] == "sdpa"
    json.dumps(table)  # plain data for the profile JSON
    with pytest.raises(ValueError, match="token counts >= 16"):
        attention_table(4, 2, 8, "cpu", torch.float32, tokens=(8,))


def test_budget_and_ranking():
    table = attention_table(4, 2, 8, "cpu", torch.float32, tokens=(16,), warmup=0, repeat=1, budget_s=0.0)
    assert len(table["not_measured"]) == 2 * len(UNIT_KINDS) and table["fastest"] == {}
    ranked = rank({"packed": {"a": [0.3, 1.0], "b": [0.5, 0.6], "c": None, "d": [0.1, None]}})
    assert ranked == {"packed": ["b", "a"]}  # summed over token counts; incomplete rows not ranked


def test_profile_cli_writes_the_table_and_the_engine_routes_by_it(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "profile.json"
    rc = prof.main(["--model", str(cfg), "--out", str(out), "--device", "cpu", "--dtype", "fp32",
                    "--lengths", "32,64,128", "--head-tokens", "32,64", "--warmup", "0", "--repeat", "1",
                    "--attention-tokens", "16,32"])
    assert rc == 0
    p = HardwareProfile.load(out)
    table = p.attention_backends
    assert table["tokens"] == [16, 32] and (table["heads"], table["kv_heads"], table["head_dim"]) == (4, 2, 16)
    assert table["fastest"] == {kind: "sdpa" for kind in UNIT_KINDS}
    assert json.loads(out.with_suffix(".rows.json").read_text())["attention_backends"] == table
    assert planning.attention_table(InfiniPipeConfig(profile=str(out))) == table
    assert planning.attention_table(InfiniPipeConfig(profile=str(out), attention_backend="sdpa")) == {}
    assert select_backend("auto", "cpu", table) is sdpa_backend
    rc = prof.main(["--model", str(cfg), "--out", str(out), "--device", "cpu", "--dtype", "fp32",
                    "--lengths", "32,64,128", "--head-tokens", "32,64", "--warmup", "0", "--repeat", "1",
                    "--attention-tokens", "none"])
    assert rc == 0 and HardwareProfile.load(out).attention_backends == {}


def test_profile_keeps_the_table_through_json():
    table = {"ranking": {"packed": ["flex", "sdpa"]}, "fastest": {"packed": "flex"}}
    p = replace(default_profile(), attention_backends=table)
    assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))).attention_backends == table
    assert default_profile().attention_backends == {}  # the shipped profile: not measured yet
