"""Loss and every parameter gradient of the pipelined model equal the unsplit float64 reference.

Each test is one launch that runs many cases (see ``workers/exact_grads.py``); the expected case
names are listed here so a case that silently stops running fails the test.
"""
from __future__ import annotations

import pytest

from tests.distributed.launch import check_cases

pytestmark = pytest.mark.distributed

PP2_CASES = ["pp2_llama_untied_ckpt_none", "pp2_mistral_tied_ckpt_all", "pp2_qwen2_untied_ckpt_mixed",
             "pp2_llama_tied_split13", "pp2_mistral_untied_ckpt_levels", "pp2_accumulation", "eval_and_clip", "plan_on_rank0",
             "rank0_plan_error_reaches_all", "plan_disagreement", "explicit_plans_differ",
             "pp_not_dividing_world",
             "pp_larger_than_layers", "unsupported_model"]
WORLD4_CASES = ["pp4_llama_untied_ckpt_mixed", "pp4_qwen2_tied_ckpt_all", "pp4_mistral_untied_ckpt_none",
                "dp2pp2_llama_tied_ckpt_mixed", "dp2pp2_mistral_untied_ckpt_all", "dp2pp2_idle_replica",
                "dp2pp2_accumulation", "default_planner_pp4", "default_planner_dp2pp2",
                "pp4_timeline"]


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("exact_pp2")
def test_pp2_exact_gradients_accumulation_eval_clip_and_errors(suite_run):
    check_cases(suite_run, 2, PP2_CASES)


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("exact_world4")
def test_pp4_and_dp2_pp2_exact_gradients(suite_run):
    check_cases(suite_run, 4, WORLD4_CASES)
