"""EPPTrainer with sharded stages (FSDP2, shard="dp", dp 2 x pp 2 on 4 gloo processes) against the
plain HF ``Trainer`` in one process: losses, grad norms and weights to float64 precision,
gradient accumulation, resume from sharded optimizer state with equal losses, ``save_model``
loading with ``from_pretrained``, a resume with another shard mode refused, LoRA.  Cases in
``workers/trainer_sharded.py``; their names are listed so a case that stops running fails.
"""
from __future__ import annotations

import re
import warnings

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import run_torchrun  # noqa: E402
from tests.distributed.workers.trainer_common import (SCENARIOS, default_planner_available,  # noqa: E402
                                                      reference_run)

pytestmark = pytest.mark.distributed
CASES = ["dp2pp2_tied_sharded", "dp2pp2_grad_accum_sharded", "dp2pp2_resume_save_sharded",
         "dp2pp2_lora_sharded"]
PLANNER = "default" if default_planner_available() else "slicing"


@pytest.mark.timeout(400)
def test_trainer_sharded_dp2_pp2(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("tied", "ga2", "base", "lora"):
            reference_run(SCENARIOS[name], str(refs))
    out = tmp_path / "out"
    r = run_torchrun("trainer_sharded.py", 4, [str(refs), str(out), PLANNER], timeout_s=360)
    assert not r.timed_out, f"launch timed out:\n{r.output[-4000:]}"
    assert r.returncode == 0, f"exit code {r.returncode}:\n{r.output[-6000:]}"
    for case in CASES:
        ranks = set(re.findall(rf"\[rank (\d+)\] CASE {case} OK", r.output))
        assert ranks == {"0", "1", "2", "3"}, f"case {case} passed on ranks {sorted(ranks)}"
    assert len(re.findall(rf"planner={PLANNER} ALL OK", r.output)) == 4
