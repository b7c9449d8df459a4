"""The host tier against the unsplit float64 HF model (``workers/offload_exact.py``): layer inputs
at the ``offload`` level, ``offload_attn``'s inputs, attention outputs and log-sum-exps,
``offload_pair``'s (no input for a pair's second layer: rebuilt in backward), and carried K/V in
host memory at pp 2 and sp 2, optimizer states on the host with a save and an exact
resume, FSDP2 CPU offload of sharded and unsharded stages' states.  The expected case names are
listed so a case that silently stops running fails the test."""
from __future__ import annotations

import pytest

from tests.distributed.launch import check_cases

pytestmark = pytest.mark.distributed

PP2_CASES = ["pp2_offload_levels_kv", "pp2_offload_levels_kv_both", "pp2_offload_attn_levels",
             "pp2_offload_attn_levels_kv", "pp2_offload_pair_levels", "pp2_optimizer_offload_resume",
             "pp2_states_offload_unsharded"]
SP2_CASES = ["sp2_offload_levels_kv", "sp2_offload_attn_levels", "sp2_offload_pair_levels", "sp2_states_offload"]


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("offload_pp2")
def test_pp2_offloaded_inputs_kv_and_host_optimizer_with_resume(suite_run):
    check_cases(suite_run, 2, PP2_CASES)


@pytest.mark.timeout(900)
@pytest.mark.merged_launch("offload_sp2")
def test_sp2_offloaded_inputs_kv_and_fsdp_cpu_offload(suite_run):
    check_cases(suite_run, 2, SP2_CASES)
