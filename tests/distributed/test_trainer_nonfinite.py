"""A NaN gradient on one rank of a 2-rank pipeline (``workers/trainer_nonfinite.py``).

By default every rank stops with the same error naming the step and that rank, exits non-zero,
and no checkpoint exists after the last good one.  With ``nonfinite_policy="skip"`` both ranks
skip that step's update and train on with finite weights; the checkpoints they save are hashed
by both ranks, and a damaged shard in the newest one makes both resume from the one before."""
from __future__ import annotations

import json
import re

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

NAMED = r"step 3: the gradient norm is nan; non-finite gradients on rank 1 \(stage 1, dp 0\): model\.layers\.\d\.mlp\.up_proj\.weight"


@pytest.mark.timeout(300)
def test_a_nan_gradient_on_rank_1_stops_every_rank_naming_step_and_rank(tmp_path):
    results = run_ranks("trainer_nonfinite.py", 2, ["stop", str(tmp_path)], timeout_s=240, agent_store=True)
    for r, res in enumerate(results):
        assert not res.timed_out, f"rank {r} hung:\n{res.output[-3000:]}"
        assert res.returncode != 0, f"rank {r} exited 0:\n{res.output[-3000:]}"
        assert re.search(r"NonFiniteError: " + NAMED, res.output), f"rank {r}:\n{res.output[-3000:]}"
        assert "non-finite gradients on rank 0" not in res.output  # rank 0's gradients were finite
        assert "finished" not in res.output
    left = sorted(p.name for p in (tmp_path / "stop").iterdir() if "checkpoint" in p.name)
    assert left == ["checkpoint-1", "checkpoint-2"], left  # nothing of step 3 or later, not even staged


@pytest.mark.timeout(300)
def test_with_skip_both_ranks_skip_the_nan_step_and_train_on(tmp_path):
    results = run_ranks("trainer_nonfinite.py", 2, ["skip", str(tmp_path)], timeout_s=240, agent_store=True)
    got = {}
    for r, res in enumerate(results):
        assert not res.timed_out and res.returncode == 0, f"rank {r}:\n{res.output[-4000:]}"
        got[r] = json.loads(re.search(rf"\[rank {r}\] RESULT (.*)", res.output).group(1))
    run = tmp_path / "skip"
    for r, res in got.items():
        assert res["steps"] == 4, (r, res)
        assert res["unchanged_by_skipped_step"] and res["changed_by_next_step"] and res["finite"], (r, res)
        assert res["scheduler_steps"] == 3, (r, res)  # the learning rate held for the skipped step
        assert res["grad_norm_is_nan"] == [False, False, True, False], (r, res)
        assert res["nonfinite_skipped_steps"] == [0, 0, 1, 1], (r, res)
        assert res["resumed"] == str(run / "checkpoint-3"), (r, res)
    assert len(got[0]["warnings"]) == 1 and re.search(NAMED + r".*Step 3 is skipped", got[0]["warnings"][0])
    assert got[1]["warnings"] == []  # one warning per job, from rank 0
    shard = run / "checkpoint-4" / "model-00002-of-00002.safetensors"
    assert got[0]["resume_skipped"] == [f"resume: skipped {run / 'checkpoint-4'}: {shard} does not match "
                                        f"its sha256 checksum (same size, different bytes: damaged or "
                                        f"overwritten after the save)"], got[0]
