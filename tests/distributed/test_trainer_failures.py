"""When one rank fails fast, every other rank's error names that rank and its error, well within
the timeout (no fake timeout); a stopped rank (SIGSTOP) is named as well (``workers/trainer_failures.py``).
Ranks are started one by one (``run_ranks``) so each rank's own message can be checked."""
from __future__ import annotations

import re

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 20  # ddp_timeout of the worker
OUTCOME = re.compile(r"\[rank (\d)\] OUTCOME after ([\d.]+)s: (.*)")


def _outcomes(mode: str, nproc: int, tmp_path) -> dict[int, tuple[float, str, int]]:
    # The store is hosted outside the ranks, as torchrun's agent hosts it.
    results = run_ranks("trainer_failures.py", nproc, [mode, str(tmp_path)], timeout_s=240, agent_store=True)
    out = {}
    for r, res in enumerate(results):
        assert not res.timed_out, f"rank {r} hung:\n{res.output[-3000:]}"
        m = OUTCOME.search(res.output)
        if m:
            out[r] = (float(m.group(2)), m.group(3), res.returncode)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, own_error", [
    ("corrupt_shard", r"model-00002-of-00002\.safetensors .*not a readable safetensors file"),
    ("missing_optimizer_shard", r"optimizer\.stage1\.pt is missing"),
    ("callback_error", r"boom from a callback on rank 1"),
])
def test_a_fast_failure_on_rank_1_is_named_on_every_rank(mode, own_error, tmp_path):
    outcomes = _outcomes(mode, 2, tmp_path)
    assert set(outcomes) == {0, 1}, outcomes
    assert re.search(own_error, outcomes[1][1]), outcomes[1][1]  # the failing rank names the file
    elapsed, text, code = outcomes[0]
    assert code == 3
    assert re.search(r"rank 1 \(stage 1, dp 0\) failed first: \w+: .*" + own_error, text), text
    assert "did not complete within" not in text, text  # no timeout that never happened
    assert elapsed < TIMEOUT_S, elapsed


@pytest.mark.slow  # 4 ranks and the peer watch's 30 s window
@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_on_every_other_rank_within_a_minute(tmp_path):
    """Default ddp_timeout (30 minutes): the stopped rank's heartbeat decides, within a minute, on
    the rank waiting for its gradients (a transfer), on its DP peer (a collective) and on rank 0
    (a collective with a live rank that itself waits on the stopped one)."""
    from infinipipe_hf.runtime.parallel.peer_watch import STALE_AFTER_S

    outcomes = _outcomes("stopped_rank", 4, tmp_path)
    assert set(outcomes) == {0, 1, 2}, outcomes
    for r, (elapsed, text, code) in outcomes.items():
        assert code == 3
        assert f"rank 3 (stage 1, dp 1) has stopped: its heartbeat stood still for {STALE_AFTER_S:g} s" in text, (r, text)
        assert "did not complete within" not in text, (r, text)
        assert elapsed < 60, (r, elapsed)
    # The first rank to judge waited the whole window; the others may read its published verdict
    # (and may have started their own waits later), so only the longest wait is bound below.
    assert max(e for e, _, _ in outcomes.values()) >= STALE_AFTER_S, outcomes
