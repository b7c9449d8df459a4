"""An invalid plan passed to ``train_step`` is refused on every rank before any communication,
within a second, with the validator's stage-by-time grid (``workers/invalid_plans.py``)."""
from __future__ import annotations

import pytest

from tests.distributed.launch import check_cases

pytestmark = pytest.mark.distributed

CASES = ["reversed_actions", "dropped_B0", "segment_past_end", "unknown_unit", "checkpoints_over_layers",
         "valid_step_after"]


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("invalid_plans")
def test_invalid_plans_are_refused_on_every_rank_before_any_communication(suite_run):
    check_cases(suite_run, 2, CASES)
