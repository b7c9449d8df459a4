"""Elastic SP rounds: units on aligned sub-groups of a stage's SP ranks (``ir.rounds``).

Exactness (``workers/sp_rounds.py``, 4 ranks): loss and every gradient on every rank equal the
unsplit float64 HF model (1e-10 relative) for pp 2 x sp 2, pp 1 x sp 4 and dp 2 x sp 2 with rounds
mixing 4-rank and 2-rank units with single-rank ones (slices with K/V on every group size, packs,
hybrids, checkpoint levels, shard "none" and "sp", GQA and MQA with fewer K/V heads than the
sub-group, odd and tiny units); every rank ran all-to-alls on exactly its units' group sizes
above one; bad plans are refused on every rank before anything runs.

Memory (``workers/sp_rounds_memory.py``, 2 ranks): a unit on one rank of an sp-2 stage keeps what
the unsplit stage keeps, on that rank only, and the planner's ``CostModel.for_group`` predicts it
within 10%.

Failures (``workers/sp_rounds_dead_rank.py``): a dead or stuck rank inside a sub-group ends every
other rank with an error naming it (or its sub-group), never a hang.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.distributed.launch import check_cases, run_ranks

CASES = ["pp2sp2_llama_mixed", "pp2sp2_qwen2_tied_levels", "pp2sp2_shard_sp_mixed", "pp2sp2_shard_sp_levels",
         "pp2sp2_mistral_odd", "sp4_gqa2_mixed", "sp4_mqa_tied_levels", "sp4_shard_sp_levels", "sp4_odd_tiny_all",
         "dp2sp2_llama_tied", "pp2sp2_planner_rounds",
         "sp4_planner_rounds_shard_sp", "bad_sequence_across_sub_groups", "bad_mix_in_round_under_shard_sp",
         "bad_plan_for_other_sp", "bad_input_then_a_good_step", "sub_group_meshes"]

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("rounds_world4")
def test_rounds_exact_gradients_on_sub_groups(suite_run):
    result = suite_run
    check_cases(result, 4, CASES)
    sizes = set(re.findall(r"CASE sp4_gqa2_mixed OK .*group_sizes=\[([\d, ]+)\]", result.output))
    assert sizes == {"1, 2, 4"}, sizes  # every rank of the sp-4 stage ran 4-, 2- and 1-rank units


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("rounds_memory")
def test_single_rank_units_keep_their_activations_on_their_rank(suite_run):
    result = suite_run
    check_cases(result, 2, [])
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(result.output, m.end())[0] for m in re.finditer(r"ROUNDMEM ", result.output)]
    assert len(rows) == 8, result.output[-3000:]  # 2 ranks x 4 checkpoint mixes
    for row in rows:
        got, unsplit, model = row["measured"], row["sp1"], row["model"]
        assert row["group_size"] == 1 and row["units"] == [row["rank"], row["rank"] + 2], row
        # A unit on one rank keeps exactly what the unsplit stage keeps for it ...
        for what in ("first_slice", "second_slice", "kv_store"):
            assert got[what] == unsplit[what] > 0, (row["mix"], what, got, unsplit)
        # ... and only there: each rank's KV store holds its own sequence's K/V, none of the other's.
        assert got["kv_sequences"] == [row["rank"]], row
        for what in ("first_slice", "second_slice", "kv_store"):
            print(row["rank"], row["mix"], what, got[what], round(model[what]), f"{got[what] / model[what]:.3f}")
            assert abs(got[what] / model[what] - 1) <= 0.10, (row["mix"], what, got[what], model[what])


TIMEOUT_S = 5.0
ERROR = re.compile(r"FAILED_AS_EXPECTED after ([\d.]+)s: (.*)")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, mode", [("sub2", "stuck"), ("single", "die")])
def test_dead_or_stuck_rank_in_a_sub_group_is_a_named_error(layout, mode, tmp_path):
    results = run_ranks("sp_rounds_dead_rank.py", 4, [layout, mode, str(TIMEOUT_S), str(tmp_path)], timeout_s=240)
    culprit = results[1]
    assert "sabotage" in culprit.output, culprit.output[-3000:]
    texts = {}
    for r in (0, 2, 3):
        res = results[r]
        assert not res.timed_out, f"rank {r} hung:\n{res.output[-3000:]}"
        assert res.returncode == 3, f"rank {r} exit {res.returncode}:\n{res.output[-3000:]}"
        m = ERROR.search(res.output)
        assert m, f"rank {r} printed no clear error:\n{res.output[-3000:]}"
        assert float(m.group(1)) < TIMEOUT_S * 2 + 10, f"rank {r} took {m.group(1)}s"
        texts[r] = m.group(2)
        assert f"rank {r} (stage" in texts[r] and "step 2" in texts[r], texts[r]
        assert any(w in texts[r] for w in ("died", "stuck", "left")), texts[r]
        if mode == "stuck":  # gave up on its own, before the stuck rank went away
            assert res.elapsed_s < culprit.elapsed_s, (r, res.elapsed_s, culprit.elapsed_s)
    if layout == "sub2":  # rank 0 shares the 2-rank sub-group with rank 1: its all-to-all names it
        assert "sequence-parallel all-to-all (unit" in texts[0] and "over ranks [0, 1]" in texts[0], texts[0]
    else:  # rank 3 is rank 1's pipeline peer (SP rank 1 of stage 1)
        assert "hidden states of unit" in texts[3] and "rank 1 (stage 0, dp 0, sp 1)" in texts[3], texts[3]
