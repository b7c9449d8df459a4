"""A dead or stuck rank ends every other rank with an error naming a peer, the step and the action,
within the p2p timeout plus a margin: never a hang.  Three ranks (pp 3): rank 1 fails, both
neighbours must report it.  Launcher limits are generous because the machine may be shared."""
from __future__ import annotations

import re

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 5.0
ERROR = re.compile(r"FAILED_AS_EXPECTED after ([\d.]+)s: rank (\d) \(stage \d, dp 0\): step 2, action ([FB]\d+|end of step.*?): (.*)")


@pytest.mark.parametrize("mode", ["die", "stuck"])
def test_other_ranks_fail_with_named_peer(mode, tmp_path):
    # A stuck rank stays until both others reported into tmp_path (past their deadlines).
    results = run_ranks("dead_rank.py", 3, [mode, str(TIMEOUT_S), str(tmp_path)], timeout_s=300)
    culprit = results[1]
    assert "sabotage" in culprit.output, culprit.output[-3000:]
    if mode == "die":
        assert culprit.returncode == 17
    for r in (0, 2):
        res = results[r]
        assert not res.timed_out, f"rank {r} hung:\n{res.output[-3000:]}"
        assert res.returncode == 3, f"rank {r} exit {res.returncode}:\n{res.output[-3000:]}"
        m = ERROR.search(res.output)
        assert m, f"rank {r} printed no clear error:\n{res.output[-3000:]}"
        elapsed, me, _action, text = m.groups()
        assert int(me) == r
        named = {int(x) for x in re.findall(r"rank (\d) \(stage", text)}
        assert named == {1}, text
        assert "died" in text or "stuck" in text, text
        assert float(elapsed) < TIMEOUT_S * 2 + 10, f"rank {r} took {elapsed}s"
        if mode == "stuck":  # exited on its own, not only once the stuck rank went away
            assert res.elapsed_s < culprit.elapsed_s, (r, res.elapsed_s, culprit.elapsed_s)


STOPPED_WITHIN_S = 60.0


@pytest.mark.slow  # the peer watch's 30 s window on 3 ranks
def test_a_stopped_rank_is_named_within_a_minute_at_the_default_deadline(tmp_path):
    """SIGSTOP: the rank neither errs nor closes its connections, and the engine's deadline is
    its default (minutes).  Its heartbeat stands still, so each neighbour's wait ends within a
    minute naming it; the stopped rank is killed only after both reported."""
    from infinipipe_hf.runtime.parallel.peer_watch import STALE_AFTER_S

    results = run_ranks("dead_rank.py", 3, ["stopped", "0", str(tmp_path)], timeout_s=300, agent_store=True)
    assert "sabotage: stopped" in results[1].output, results[1].output[-3000:]
    took = []
    for r in (0, 2):
        res = results[r]
        assert not res.timed_out and res.returncode == 3, f"rank {r} exit {res.returncode}:\n{res.output[-3000:]}"
        m = ERROR.search(res.output)
        assert m, f"rank {r} printed no clear error:\n{res.output[-3000:]}"
        elapsed, me, _action, text = m.groups()
        assert int(me) == r
        assert f"rank 1 (stage 1, dp 0) has stopped: its heartbeat stood still for {STALE_AFTER_S:g} s" in text, text
        assert float(elapsed) < STOPPED_WITHIN_S, f"rank {r} took {elapsed}s"
        took.append(float(elapsed))
    # The first rank to judge waited the whole window; the other may read its published verdict
    # (and may have started its own wait later), so only the longer wait is bound below.
    assert max(took) >= STALE_AFTER_S, took
    assert results[1].returncode == -9  # still stopped when both had reported


def test_a_slow_rank_that_keeps_beating_is_not_called_stopped():
    """Rank 1 computes for four peer-watch windows (shortened to 2 s) while its neighbours wait
    on it: its heartbeat thread keeps beating, so step 2 finishes everywhere."""
    results = run_ranks("dead_rank.py", 3, ["slow"], timeout_s=300, agent_store=True)
    assert "sabotage: slow" in results[1].output, results[1].output[-3000:]
    for r, res in enumerate(results):
        assert res.returncode == 0 and "step 2 finished without error" in res.output, \
            f"rank {r} exit {res.returncode}:\n{res.output[-3000:]}"


def test_mesh_groups_fsdp2_runs_on_take_the_layout_timeout(tmp_path):
    """FSDP2's collectives run on the DeviceMesh's groups: a missing peer ends them within the
    layout's timeout, not the default group's 30 minutes."""
    timeout = 3.0
    results = run_ranks("mesh_timeout.py", 4, [str(timeout), str(tmp_path)], timeout_s=240)
    res = results[0]
    assert not res.timed_out, f"rank 0 hung:\n{res.output[-3000:]}"
    assert res.returncode == 3, f"rank 0 exit {res.returncode}:\n{res.output[-3000:]}"
    m = re.search(r"RAISED_AFTER ([\d.]+)", res.output)
    assert m, res.output[-3000:]
    assert timeout * 0.8 < float(m.group(1)) < timeout * 2 + 10, m.group(1)
