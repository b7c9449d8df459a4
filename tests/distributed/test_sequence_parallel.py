"""Ulysses sequence parallelism: exactness against the unsplit model, memory per rank, failures.

Exactness (``workers/sp_exact.py``): loss and every gradient on every rank equal single-process
HF in float64 (1e-10 relative) for sp 2, pp 2 x sp 2, pp 1 x sp 4 and dp 2 x sp 2, with slices
carrying K/V, packs, hybrids, checkpointing (whole layers and every finer level, keep_attn
included), every schedule of the default planner, GQA with 2 K/V
heads at sp 4 (K/V heads shared by 2 ranks: the K/V store sharded over them, ``test_kv_shards.py``), uneven head counts, K/V expanded per query head, tied embeddings,
units of odd length and units shorter than ``sp_degree``; plus accumulation, clipping, eval and
the bad-input errors.  The case names are listed so a case that stops running fails the test.

Memory (``workers/sp_memory.py``): bytes saved for backward per rank for the same unit at sp 2
against sp 1, and the KV store's bytes per rank.

Failures (``workers/sp_dead_rank.py``): a dead or stuck SP peer is an error naming the SP ranks,
never a hang.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.distributed.launch import check_cases, run_ranks

SP2_CASES = ["sp2_llama_untied_mixed", "sp2_qwen3_tied_all", "sp2_mistral_odd_units",
             "sp2_gqa6_3_expanded", "sp2_llama_levels", "sp2_accumulation_clip", "sp_not_dividing_world",
             "pp_sp_not_dividing_world", "sp_more_than_heads"]
WORLD4_CASES = ["pp2sp2_llama_untied_mixed", "pp2sp2_mistral_tied_all", "pp2sp2_qwen2_untied_none_odd",
                "pp2sp2_qwen3_tied_mixed", "sp4_gqa2_replicated", "sp4_gqa8_2_tied",
                "sp4_gqa10_5_expanded", "sp4_mha6_uneven_heads", "sp4_gqa10_5_expanded_levels",
                "pp2sp2_qwen2_levels", "sp4_odd_and_tiny_units",
                "dp2sp2_llama_tied_mixed", "dp2sp2_qwen2_untied_all", "pp2sp2_accumulation_clip",
                "pp2sp2_planner_epp", "pp2sp2_planner_packed-1f1b", "pp2sp2_planner_seq1f1b",
                "pp2sp2_planner_gpipe", "sp_not_dividing_world", "pp_sp_not_dividing_world",
                "sp_more_than_heads"]

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("sp2_exact")
def test_sp2_exact_gradients_and_errors(suite_run):
    check_cases(suite_run, 2, SP2_CASES)


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("sp_exact_world4")
def test_pp2_sp2_sp4_dp2_sp2_exact_gradients_every_schedule(suite_run):
    check_cases(suite_run, 4, WORLD4_CASES)


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("sp2_memory")
def test_sp2_halves_saved_activations_and_kv_store_per_rank(suite_run):
    result = suite_run
    check_cases(result, 2, [])
    # Ranks print to one pipe, so two ranks' lines may run together: decode each object alone.
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(result.output, m.end())[0] for m in re.finditer(r"MEM ", result.output)]
    assert len(rows) == 4, result.output[-3000:]  # 2 ranks x (0 and 2 checkpointed layers)
    for row in rows:
        one, two, ratio = row["sp1"], row["sp2"], row["ratio"]
        print(row["checkpointed_layers"], ratio)
        # Each rank keeps its half of the tokens' activations...
        assert 0.45 <= ratio["first_slice_saved_bytes"] <= 0.55, ratio
        # ... plus, per non-checkpointed layer, the attention output twice (SDPA keeps the
        # head-sharded one, o_proj the token-sharded one; unsplit they share one buffer):
        # T * q_dim * 4 bytes / sp.  Predicted to within 1%.
        layers_kept = 4 - row["checkpointed_layers"]
        predicted = one["first_slice_saved_bytes"] / 2 + layers_kept * 512 * 256 * 4 / 2
        assert abs(two["first_slice_saved_bytes"] / predicted - 1) <= 0.01, (two, predicted)
        # The second slice also keeps the SDPA backend's dense context mask, which is not sharded
        # (it does not depend on heads): less than half saved, but well below sp 1.
        assert ratio["second_slice_saved_bytes"] <= 0.65, ratio
        # The KV store holds this rank's 2 of 4 K/V heads: exactly half, in real storage too.
        assert ratio["kv_store_bytes"] == 0.5 and ratio["kv_store_storage_bytes"] == 0.5, ratio


TIMEOUT_S = 5.0
ERROR = re.compile(r"FAILED_AS_EXPECTED after ([\d.]+)s: (.*)")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["die", "stuck"])
def test_dead_or_stuck_sp_peer_is_a_named_error(mode, tmp_path):
    results = run_ranks("sp_dead_rank.py", 2, [mode, str(TIMEOUT_S), str(tmp_path)], timeout_s=240)
    culprit, survivor = results[1], results[0]
    assert "sabotage" in culprit.output, culprit.output[-3000:]
    assert not survivor.timed_out, f"rank 0 hung:\n{survivor.output[-3000:]}"
    assert survivor.returncode == 3, f"rank 0 exit {survivor.returncode}:\n{survivor.output[-3000:]}"
    m = ERROR.search(survivor.output)
    assert m, f"rank 0 printed no clear error:\n{survivor.output[-3000:]}"
    elapsed, text = float(m.group(1)), m.group(2)
    assert "rank 0 (stage 0, dp 0, sp 0): step 2" in text, text
    assert "sequence-parallel all-to-all (unit" in text and "layer" in text, text
    assert "over ranks [0, 1]" in text and ("died" in text or "stuck" in text), text
    assert elapsed < TIMEOUT_S * 2 + 10, f"rank 0 took {elapsed}s"
    if mode == "stuck":  # it gave up on its own, before the stuck rank went away
        assert survivor.elapsed_s < culprit.elapsed_s, (survivor.elapsed_s, culprit.elapsed_s)
