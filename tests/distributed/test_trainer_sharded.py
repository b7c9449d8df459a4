"""EPPTrainer with sharded stages (FSDP2, shard="dp", dp 2 x pp 2 on 4 gloo processes) against the
plain HF ``Trainer`` in one process: losses, grad norms and weights to float64 precision,
gradient accumulation, resume from sharded optimizer state with equal losses, ``save_model``
loading with ``from_pretrained``, a resume with another shard mode refused, LoRA.  Cases in
``workers/trainer_sharded.py``; their names are listed so a case that stops running fails.
"""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases, run_torchrun  # noqa: E402
from tests.distributed.workers.trainer_common import SCENARIOS, reference_run  # noqa: E402

pytestmark = pytest.mark.distributed
CASES = ["dp2pp2_tied_sharded", "dp2pp2_grad_accum_sharded", "dp2pp2_resume_save_sharded",
         "dp2pp2_lora_sharded"]
PLANNER = "default"  # the engine's own planner (workers also take "slicing": a fixed sliced plan)


@pytest.mark.timeout(400)
def test_trainer_sharded_dp2_pp2(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("tied", "ga2", "base", "lora"):
            reference_run(SCENARIOS[name], str(refs), dp_degrees=(1, 2))
    out = tmp_path / "out"
    r = run_torchrun("trainer_sharded.py", 4, [str(refs), str(out), PLANNER], timeout_s=360)
    check_cases(r, 4, CASES, all_ok=f"planner={PLANNER} ALL OK")
