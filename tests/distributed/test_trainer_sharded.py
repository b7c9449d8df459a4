"""EPPTrainer with sharded stages (FSDP2, shard="dp", dp 2 x pp 2 on 4 gloo processes) against the
plain HF ``Trainer`` in one process: losses, grad norms and weights to float64 precision,
gradient accumulation, resume from sharded optimizer state with equal losses, ``save_model``
loading with ``from_pretrained``, a resume with another shard mode refused, LoRA.  Cases in
``workers/trainer_sharded.py``; their names are listed so a case that stops running fails.
"""
from __future__ import annotations

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases  # noqa: E402

pytestmark = pytest.mark.distributed
CASES = ["dp2pp2_tied_sharded", "dp2pp2_grad_accum_sharded", "dp2pp2_resume_save_sharded",
         "dp2pp2_lora_sharded"]
PLANNER = "default"  # the engine's own planner (workers also take "slicing": a fixed sliced plan)


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("trainer_sharded")  # trainer_sharded.py REFS OUT default
def test_trainer_sharded_dp2_pp2(suite_run):
    check_cases(suite_run, 4, CASES, all_ok=f"planner={PLANNER} ALL OK")
