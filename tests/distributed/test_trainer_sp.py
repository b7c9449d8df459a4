"""EPPTrainer with ``EPPTrainingArguments(sp_degree=2)`` on 4 CPU processes (torchrun, gloo).

pp 2 x sp 2 and dp 2 x sp 2 (also on documents longer than ``tokens_per_step``, each DP replica
fed its own pieces) against the single-process HF ``Trainer`` on the same global batches
(``workers/trainer_sp.py``): losses, grad norms, trained weights, eval loss; ``save_model`` loads
with ``from_pretrained``.  ``EPPTrainingArguments`` takes its pipeline fields (``sp_degree``
among them) from ``InfiniPipeConfig``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases  # noqa: E402

pytestmark = pytest.mark.distributed
CASES = ["pp2sp2_base_eval", "dp2sp2_tied_save", "dp2sp2_long_docs"]
PLANNER = "default"  # the engine's own planner (workers also take "slicing": a fixed sliced plan)


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("trainer_sp")  # trainer_sp.py REFS OUT default
def test_trainer_pp2_sp2_and_dp2_sp2_match_hf_trainer(suite_run):
    check_cases(suite_run, 4, CASES, all_ok=f"planner={PLANNER} ALL OK")
