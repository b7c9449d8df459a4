"""Layout errors come before any tokenization; a text dataset is tokenized once per job (rank 0,
its time logged) and loaded by the other ranks (``workers/prepare_once.py``)."""
from __future__ import annotations

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import check_cases, run_torchrun  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(300)
def test_layout_errors_before_tokenizing_and_tokenization_once(tmp_path):
    res = run_torchrun("prepare_once.py", 2, [str(tmp_path)], timeout_s=240)
    check_cases(res, 2, ["layout_error_before_tokenizing", "tokenized_once"])
    logged = [line for line in res.output.splitlines() if "prepared train_dataset" in line]
    assert len(logged) == 1 and "on rank 0" in logged[0], logged  # once per job, with its time
    assert " s on rank 0; the other ranks load it from " in logged[0]
    warned = [line for line in res.output.splitlines() if "are longer than tokens_per_step" in line]
    assert len(warned) == 1 and "prepare_once.py" in warned[0], warned  # once per job, at the user's line
