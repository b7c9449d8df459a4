"""A dead or stuck rank ends every other rank with an error naming a peer, the step and the action,
within the p2p timeout plus a margin: never a hang.  Three ranks (pp 3): rank 1 fails, both
neighbours must report it.  Launcher limits are generous because the machine may be shared."""
from __future__ import annotations

import re

import pytest

from tests.distributed.launch import run_ranks

TIMEOUT_S = 5.0
ERROR = re.compile(r"FAILED_AS_EXPECTED after ([\d.]+)s: rank (\d) \(stage \d, dp 0\): step 2, action ([FB]\d+|end of step.*?): (.*)")


@pytest.mark.parametrize("mode", ["die", "stuck"])
def test_other_ranks_fail_with_named_peer(mode):
    results = run_ranks("dead_rank.py", 3, [mode, str(TIMEOUT_S)], timeout_s=300)
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


def test_mesh_groups_fsdp2_runs_on_take_the_layout_timeout():
    """FSDP2's collectives run on the DeviceMesh's groups: a missing peer ends them within the
    layout's timeout, not the default group's 30 minutes."""
    timeout = 3.0
    results = run_ranks("mesh_timeout.py", 4, [str(timeout)], timeout_s=240)
    res = results[0]
    assert not res.timed_out, f"rank 0 hung:\n{res.output[-3000:]}"
    assert res.returncode == 3, f"rank 0 exit {res.returncode}:\n{res.output[-3000:]}"
    m = re.search(r"RAISED_AFTER ([\d.]+)", res.output)
    assert m, res.output[-3000:]
    assert timeout * 0.8 < float(m.group(1)) < timeout * 2 + 10, m.group(1)
