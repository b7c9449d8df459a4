"""EPPTrainer with ``pp_degree="auto"`` on 2 CPU processes (torchrun, gloo): the layout search
runs at start-up on rank 0, every rank builds its choice, and training matches the
single-process HF ``Trainer`` on the same global batches (``workers/trainer_auto.py``)."""
from __future__ import annotations

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases  # noqa: E402

pytestmark = pytest.mark.distributed
CASES = ["auto_base", "auto_sp2", "auto_no_layout"]


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("trainer_auto")  # trainer_auto.py REFS OUT
def test_auto_layout_is_agreed_trains_exactly_and_fails_alike(suite_run):
    check_cases(suite_run, 2, CASES, all_ok="ALL OK")
