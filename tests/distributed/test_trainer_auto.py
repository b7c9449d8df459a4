"""EPPTrainer with ``pp_degree="auto"`` on 2 CPU processes (torchrun, gloo): the layout search
runs at start-up on rank 0, every rank builds its choice, and training matches the
single-process HF ``Trainer`` on the same global batches (``workers/trainer_auto.py``)."""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases, run_torchrun  # noqa: E402
from tests.distributed.workers.trainer_common import SCENARIOS, reference_run  # noqa: E402

pytestmark = pytest.mark.distributed
CASES = ["auto_base", "auto_sp2", "auto_no_layout"]


@pytest.mark.timeout(400)
def test_auto_layout_is_agreed_trains_exactly_and_fails_alike(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_run(SCENARIOS["base"], str(refs), dp_degrees=(1, 2))
    r = run_torchrun("trainer_auto.py", 2, [str(refs), str(tmp_path / "out")], timeout_s=360)
    check_cases(r, 2, CASES, all_ok="ALL OK")
