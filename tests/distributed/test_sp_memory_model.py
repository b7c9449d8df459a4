"""The planner's memory model at sp 2 against what each SP rank saves (``workers/sp_memory_model.py``).

Per rank and unit: bytes autograd keeps for backward (``saved_tensors_hooks``, checkpoint inputs
included) for a whole 512-token slice and a 512-token slice behind 512 tokens of context, with
layers checkpointed whole, at keep_attn and at the MLP levels, against ``CostModel(sp_degree=2)``'s
``unit_activation_bytes`` from the cost model's float32 formula: within 10%.  The model keeps the
attention output twice per non-checkpointed layer under SP (``UlyssesCost.activation_scale``) and
the SDPA context mask whole on every rank (it does not depend on heads); the KV store holds half
the K/V heads.
"""
from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("sp2_memory_model")
def test_memory_model_matches_sp2_ranks(suite_run):
    result = suite_run
    assert result.returncode == 0 and result.output.count("ALL OK") == 2, result.output[-4000:]
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(result.output, m.end())[0] for m in re.finditer(r"MODEL ", result.output)]
    assert len(rows) == 16, result.output[-3000:]  # 2 ranks x 8 checkpoint mixes
    for row in rows:
        for what in ("first_slice", "second_slice", "kv_store"):
            got, want = row[what]["measured"], row[what]["model"]
            print(row["mix"], what, got, round(want), f"{got / want:.3f}")
            assert abs(got / want - 1) <= 0.10, (row["mix"], what, got, want)
