"""EPPTrainer with ``EPPTrainingArguments(sp_degree=2)`` on 4 CPU processes (torchrun, gloo).

pp 2 x sp 2 and dp 2 x sp 2 (also on documents longer than ``tokens_per_step``, each DP replica
fed its own pieces) against the single-process HF ``Trainer`` on the same global batches
(``workers/trainer_sp.py``): losses, grad norms, trained weights, eval loss; ``save_model`` loads
with ``from_pretrained``.  ``EPPTrainingArguments`` takes its pipeline fields (``sp_degree``
among them) from ``InfiniPipeConfig``.
"""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases, run_torchrun  # noqa: E402
from tests.distributed.workers.trainer_common import SCENARIOS, reference_run  # noqa: E402

pytestmark = pytest.mark.distributed
CASES = ["pp2sp2_base_eval", "dp2sp2_tied_save", "dp2sp2_long_docs"]
PLANNER = "default"  # the engine's own planner (workers also take "slicing": a fixed sliced plan)


@pytest.mark.timeout(400)
def test_trainer_pp2_sp2_and_dp2_sp2_match_hf_trainer(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("base", "tied", "long_docs"):
            reference_run(SCENARIOS[name], str(refs), dp_degrees=(1, 2))
    r = run_torchrun("trainer_sp.py", 4, [str(refs), str(tmp_path / "out"), PLANNER], timeout_s=360)
    check_cases(r, 4, CASES, all_ok=f"planner={PLANNER} ALL OK")
