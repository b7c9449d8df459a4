"""Restarts lose nothing: under ``torchrun --max-restarts 1`` a rank killed after a checkpoint, or
during a save, ends a job that resumes by itself from the newest complete checkpoint and finishes
with the weights of an uninterrupted run (``workers/trainer_restart.py``; recipe in
docs/recovery.md)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tests.distributed.launch import run_torchrun  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
RTOL = 1e-12  # the resumed steps are those of the uninterrupted run (as the resume tests assert)


def _run(mode: str, out) -> str:
    res = run_torchrun("trainer_restart.py", 2, [mode, str(out)], timeout_s=180,
                       torchrun_args=["--max-restarts", "1"])
    assert not res.timed_out and res.returncode == 0, f"{mode}: exit {res.returncode}\n{res.output[-5000:]}"
    return res.output


def _final(out, mode: str) -> dict:
    from safetensors.torch import load_file

    return {r: load_file(os.path.join(out, mode, f"final-rank{r}.safetensors")) for r in (0, 1)}


def _assert_same_weights(got: dict, want: dict, mode: str) -> None:
    for r in (0, 1):
        assert got[r].keys() == want[r].keys() and got[r], (mode, r)
        for name, w in want[r].items():
            err = (got[r][name] - w).abs().max().item()
            assert err <= RTOL * max(w.abs().max().item(), 1e-30), (mode, r, name, err)


@pytest.mark.timeout(400)
def test_a_killed_rank_restarts_and_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # a fresh store per attempt: docs/recovery.md
    text = _run("uninterrupted", tmp_path)
    assert text.count("ATTEMPT 0 DONE at step 6") == 2, text[-3000:]
    want = _final(tmp_path, "uninterrupted")

    text = _run("kill_after_checkpoint", tmp_path)
    assert "killing myself as step 3 begins" in text
    assert text.count("ATTEMPT 1 DONE at step 6") == 2, text[-3000:]
    assert "restart 1 of the job: resuming from" in text and "checkpoint-2" in text, text[-3000:]
    _assert_same_weights(_final(tmp_path, "kill_after_checkpoint"), want, "kill_after_checkpoint")

    text = _run("kill_during_save", tmp_path)
    run_dir = tmp_path / "kill_during_save"
    assert "killing myself during the save of step 4" in text
    assert text.count("ATTEMPT 1 DONE at step 6") == 2, text[-3000:]
    assert f"resume: skipped {run_dir / 'tmp-checkpoint-4'}: a save that did not finish" in text, text[-3000:]
    assert f"resuming from {run_dir / 'checkpoint-2'}" in text, text[-3000:]
    _assert_same_weights(_final(tmp_path, "kill_during_save"), want, "kill_during_save")
    published = sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name)
    assert published == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], published  # nothing half written
