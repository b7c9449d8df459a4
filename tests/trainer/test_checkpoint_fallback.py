"""A checkpoint damaged on disk cannot poison a run (one process, a real trainer).

The user's report: random bytes over the last 64 KiB of the newest checkpoint's weights (same
size), then ``resume_from_checkpoint=True``: the run trained on NaN, saved an all-NaN checkpoint
and exited 0.  Now the resume passes over the damaged checkpoint naming the file, continues from
the older intact one with the losses of an uninterrupted run, and re-saves a finite checkpoint.
Without checksums (a manifest from before they were recorded) the damage loads, and the
non-finite guard stops the job at its first step instead of saving NaN."""
from __future__ import annotations

import json
import os
import random
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("datasets")

from infinipipe_hf.trainer.checkpoints.publish import MANIFEST_NAME, verify_checkpoint  # noqa: E402
from infinipipe_hf.trainer.nonfinite import NonFiniteError  # noqa: E402
from tests.distributed.workers.trainer_common import (  # noqa: E402
    SCENARIOS,
    assert_close_list,
    epp_trainer,
    per_step,
    slicing_planner,
    stage_state,
)

SCN = SCENARIOS["base"]
TAIL = 64 * 1024


def _trainer(out, **over):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return epp_trainer(SCN, str(out), 1, planner=slicing_planner, save_strategy="steps", **over)


def _overwrite_tail(path, data: bytes) -> None:
    size = os.path.getsize(path)
    assert size > 2 * TAIL  # the tail is tensor data, not the header
    with open(path, "r+b") as fh:
        fh.seek(size - len(data))
        fh.write(data)
    assert os.path.getsize(path) == size


def _all_finite(folder) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(os.path.join(folder, "model.safetensors")).values())


def test_resume_true_passes_over_a_damaged_newest_checkpoint_and_never_trains_on_nan(tmp_path):
    a = _trainer(tmp_path, save_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.train()
    newest = tmp_path / "checkpoint-4"
    damaged = newest / "model.safetensors"
    _overwrite_tail(damaged, random.Random(0).randbytes(TAIL))

    b = _trainer(tmp_path, save_steps=2)
    with pytest.raises(ValueError, match=rf"cannot resume from {newest}: {damaged} does not match its sha256"):
        b.train(resume_from_checkpoint=str(newest))  # named explicitly: refused, nothing loaded
    with pytest.warns(UserWarning) as seen:
        b.train(resume_from_checkpoint="True")  # what `--resume_from_checkpoint True` passes
    skipped = [str(w.message) for w in seen if "resume: skipped" in str(w.message)]
    assert skipped == [f"resume: skipped {newest}: {damaged} does not match its sha256 checksum (same size, "
                       f"different bytes: damaged or overwritten after the save)"], skipped

    # steps 3 and 4 again, from checkpoint-2: the uninterrupted run's losses, its weights
    assert_close_list(per_step(b, SCN), per_step(a, SCN)[2:], "losses after the fallback", 1e-12)
    logs = [h for h in b.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4]  # 1 and 2 from checkpoint-2's trainer state
    assert all(torch.isfinite(torch.tensor([h["loss"], h["grad_norm"]])).all() for h in logs)
    want = stage_state(a)
    for name, t in stage_state(b).items():
        torch.testing.assert_close(t, want[name], rtol=1e-12, atol=1e-14)
    assert verify_checkpoint(str(newest)) is None and _all_finite(newest)  # re-saved, intact


def test_without_checksums_the_damage_loads_and_the_job_stops_before_saving_nan(tmp_path):
    a = _trainer(tmp_path, save_steps=2, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.train()
    ckpt = tmp_path / "checkpoint-2"
    manifest = ckpt / MANIFEST_NAME
    manifest.write_text(json.dumps({"files": json.loads(manifest.read_text())["files"]}))  # sizes only
    _overwrite_tail(ckpt / "model.safetensors", b"\xff" * TAIL)  # 0xff..ff is a float NaN
    assert verify_checkpoint(str(ckpt)) is None  # sizes cannot see it

    b = _trainer(tmp_path, save_steps=1)
    with pytest.warns(UserWarning, match="records file sizes only"):
        with pytest.raises(NonFiniteError, match=r"^step 3: the loss is nan and the gradient norm is nan; "
                                                 r"non-finite token losses on rank 0 \(stage 0, dp 0\) from "
                                                 r"unit \d+ \(seq \d+ tokens \d+:\d+"):
            b.train(resume_from_checkpoint=True)
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
