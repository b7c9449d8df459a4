"""Checkpoints are published whole and verified on load: a manifest of every file and its size,
resume takes the newest complete checkpoint and names every newer one it skipped and why, and
damaged or unsafe files are refused naming the file."""
from __future__ import annotations

import os
import pickle

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf.trainer.checkpoints import optimizer as optimizer_files  # noqa: E402
from infinipipe_hf.trainer.checkpoints import weights as weight_files  # noqa: E402
from infinipipe_hf.trainer.checkpoints.publish import (  # noqa: E402
    MANIFEST_NAME,
    staging_dir,
    verify_checkpoint,
    write_manifest,
)
from infinipipe_hf.trainer.checkpoints.resume import newest_complete_checkpoint, resolve_resume  # noqa: E402


def _checkpoint(root, name: str, published: bool = True):
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    (folder / "optimizer.stage0.pt").write_bytes(b"y" * 50)
    if published:
        write_manifest(str(folder))
    return folder


def test_manifest_lists_every_file_and_verification_names_the_damaged_one(tmp_path):
    folder = _checkpoint(tmp_path, "checkpoint-2")
    assert verify_checkpoint(str(folder)) is None
    (folder / "optimizer.stage0.pt").write_bytes(b"y" * 10)
    why = verify_checkpoint(str(folder))
    assert "optimizer.stage0.pt has 10 bytes but 50 were saved" in why
    (folder / "model.safetensors").unlink()
    assert "model.safetensors is missing" in verify_checkpoint(str(folder))
    (folder / MANIFEST_NAME).unlink()
    assert MANIFEST_NAME in verify_checkpoint(str(folder))
    assert staging_dir(str(folder)) == str(tmp_path / "tmp-checkpoint-2")


def test_resume_takes_the_newest_complete_checkpoint_and_names_the_skipped_ones(tmp_path):
    _checkpoint(tmp_path, "checkpoint-2")
    bad = _checkpoint(tmp_path, "checkpoint-4")
    (bad / "model.safetensors").write_bytes(b"x")
    _checkpoint(tmp_path, "tmp-checkpoint-6", published=False)
    path, skipped = newest_complete_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "checkpoint-2")
    assert len(skipped) == 2
    assert skipped[0].startswith(str(tmp_path / "tmp-checkpoint-6")) and "did not finish" in skipped[0]
    assert "checkpoint-4" in skipped[1] and "has 1 bytes but 100 were saved" in skipped[1]
    with pytest.warns(UserWarning, match="resume: skipped .*tmp-checkpoint-6"):
        assert resolve_resume(True, str(tmp_path), True) == str(tmp_path / "checkpoint-2")


def test_resume_true_without_a_complete_checkpoint_refuses_and_a_restart_starts_over(tmp_path, monkeypatch):
    _checkpoint(tmp_path, "tmp-checkpoint-2", published=False)
    with pytest.warns(UserWarning, match="did not finish"):
        with pytest.raises(ValueError, match="holds no complete checkpoint .1 passed over"):
            resolve_resume(True, str(tmp_path), True)
    assert resolve_resume(None, str(tmp_path), True) is None  # a first attempt: nothing to resume
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.warns(UserWarning):
        assert resolve_resume(None, str(tmp_path), True) is None  # restarted, nothing complete: step 0
    assert resolve_resume(None, str(tmp_path), False) is None
    good = _checkpoint(tmp_path, "checkpoint-1")
    assert resolve_resume(None, str(tmp_path), True) == str(good)  # restarted: resumes by itself


def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    folder = _checkpoint(tmp_path, "checkpoint-3")
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot resume from .*model\.safetensors has 0 bytes"):
        resolve_resume(str(folder), str(tmp_path), True)


def test_optimizer_state_loads_weights_only_and_names_a_bad_file(tmp_path):
    good = tmp_path / "optimizer.stage0.pt"
    torch.save({"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}, good)
    assert optimizer_files._load(str(good), "cpu")["state"][0]["step"] == 3
    unsafe = tmp_path / "unsafe.pt"
    with open(unsafe, "wb") as fh:
        pickle.dump({"x": os.system}, fh)  # an arbitrary callable: never unpickled
    with pytest.raises(ValueError, match=r"unsafe\.pt .* cannot be loaded with weights_only=True"):
        optimizer_files._load(str(unsafe), "cpu")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"truncated\.pt \(40 bytes\).*truncated or damaged"):
        optimizer_files._load(str(truncated), "cpu")


def test_a_damaged_safetensors_file_is_named(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(path))
    assert weight_files._checkpoint_files(str(tmp_path)) == {"w": str(path)}
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match=r"model\.safetensors \(\d+ bytes\) is not a readable safetensors file"):
        weight_files._checkpoint_files(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"index\.json is not a readable safetensors index"):
        weight_files._checkpoint_files(str(tmp_path))


def test_a_restartable_launch_without_a_fresh_store_per_attempt_is_warned_about():
    from infinipipe_hf.trainer.checkpoints.resume import restart_setup_note

    assert restart_setup_note({}) is None
    assert restart_setup_note({"TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_setup_note({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    note = restart_setup_note({"TORCHELASTIC_MAX_RESTARTS": "2"})
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in note and "max-restarts 2" in note
