"""Checkpoints are published whole and verified on load: a manifest of every file with its size and SHA-256,
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


# --- checksums -------------------------------------------------------------------------------
TAIL = 64 * 1024


def _safetensors_checkpoint(root, name: str, seed: int = 0):
    """A checkpoint folder with a real safetensors file larger than ``TAIL`` and a manifest."""
    from safetensors.torch import save_file

    folder = root / name
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(40_000, generator=g), "b": torch.randn(8, generator=g)},
              str(folder / "model.safetensors"))
    (folder / "scheduler.pt").write_bytes(b"s" * 30)
    write_manifest(str(folder))
    return folder


def _overwrite(path, offset: int, data: bytes) -> None:
    """Same size, different bytes: what a size check cannot see."""
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)
    assert os.path.getsize(path) == size


def _corrupt_tail(path, seed: int = 1) -> None:
    import random

    size = os.path.getsize(path)
    _overwrite(path, size - TAIL, random.Random(seed).randbytes(TAIL))


def _sizes_only(folder) -> None:
    """Rewrite the manifest as saves wrote it before checksums were recorded."""
    import json

    path = folder / MANIFEST_NAME
    files = json.loads(path.read_text())["files"]
    path.write_text(json.dumps({"files": files}))


def test_the_manifest_records_a_sha256_per_file_that_sha256sum_would_print(tmp_path):
    import hashlib
    import json

    folder = _safetensors_checkpoint(tmp_path, "checkpoint-1")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["checksum"] == "sha256"
    assert set(manifest["checksums"]) == set(manifest["files"]) == {"model.safetensors", "scheduler.pt"}
    for name, digest in manifest["checksums"].items():
        assert digest == hashlib.sha256((folder / name).read_bytes()).hexdigest()


@pytest.mark.parametrize("where", ["data", "header"])
def test_same_size_damage_of_a_safetensors_file_is_found_and_named(tmp_path, where):
    folder = _safetensors_checkpoint(tmp_path, "checkpoint-2")
    path = folder / "model.safetensors"
    assert verify_checkpoint(str(folder)) is None
    if where == "data":
        _corrupt_tail(path)
    else:  # the 8-byte header length and the start of the JSON header
        _overwrite(path, 0, b"\xff" * 8 + b"{garbage")
    why = verify_checkpoint(str(folder))
    assert why is not None and f"{path} does not match its sha256 checksum" in why, why
    assert "scheduler.pt" not in why  # only the damaged file is named
    _sizes_only(folder)  # the same damage is invisible to sizes alone: the checksum found it
    assert verify_checkpoint(str(folder)) is None


def test_an_explicit_checkpoint_with_a_damaged_file_is_refused_naming_it(tmp_path):
    folder = _safetensors_checkpoint(tmp_path, "checkpoint-3")
    _corrupt_tail(folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"cannot resume from .*checkpoint-3: .*checkpoint-3/model\.safetensors "
                                         r"does not match its sha256 checksum"):
        resolve_resume(str(folder), str(tmp_path), True)
    (folder / MANIFEST_NAME).write_text("{not json")  # a damaged manifest is damage too
    with pytest.raises(ValueError, match=r"cannot resume from .*epp_manifest\.json is unreadable"):
        resolve_resume(str(folder), str(tmp_path), True)


@pytest.mark.parametrize("value", [True, "True", "true"])
def test_resume_true_falls_back_to_the_newest_intact_checkpoint_and_names_the_damaged_one(tmp_path, value):
    _safetensors_checkpoint(tmp_path, "checkpoint-2")
    good = _safetensors_checkpoint(tmp_path, "checkpoint-4", seed=1)
    bad = _safetensors_checkpoint(tmp_path, "checkpoint-6", seed=2)
    _corrupt_tail(bad / "model.safetensors")
    with pytest.warns(UserWarning) as seen:
        assert resolve_resume(value, str(tmp_path), True) == str(good)
    skipped = [str(w.message) for w in seen if "resume: skipped" in str(w.message)]
    assert len(skipped) == 1, skipped
    assert f"checkpoint-6: {bad}/model.safetensors does not match its sha256 checksum" in skipped[0]


def test_a_restarted_job_falls_back_past_a_damaged_checkpoint_too(tmp_path, monkeypatch):
    good = _safetensors_checkpoint(tmp_path, "checkpoint-1")
    bad = _safetensors_checkpoint(tmp_path, "checkpoint-2", seed=1)
    _overwrite(bad / "model.safetensors", 0, b"\x00" * 8)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.warns(UserWarning, match=r"resume: skipped .*checkpoint-2: .*does not match"):
        assert resolve_resume(None, str(tmp_path), True) == str(good)


def test_a_manifest_without_checksums_still_resumes_with_a_notice_and_checks_sizes(tmp_path):
    old = _safetensors_checkpoint(tmp_path, "checkpoint-5")
    _sizes_only(old)
    for value in (True, str(old)):
        with pytest.warns(UserWarning, match=r"checkpoint-5: its manifest records file sizes only"):
            assert resolve_resume(value, str(tmp_path), True) == str(old)
    (old / "scheduler.pt").write_bytes(b"s")
    with pytest.raises(ValueError, match=r"scheduler\.pt has 1 bytes but 30 were saved"):
        resolve_resume(str(old), str(tmp_path), True)


def test_files_are_shared_out_over_ranks_by_size_each_exactly_once():
    from infinipipe_hf.trainer.checkpoints.integrity import Exchange, shares

    sizes = {"model-1.safetensors": 900, "model-2.safetensors": 800, "optimizer.stage0.pt": 1700,
             "optimizer.stage1.pt": 1600, "scheduler.pt": 1, "config.json": 2}
    parts = shares(sizes, 2)
    assert sorted(n for p in parts for n in p) == sorted(sizes)
    loads = [sum(sizes[n] for n in p) for p in parts]
    assert max(loads) - min(loads) <= 200, parts
    assert parts == shares(dict(reversed(list(sizes.items()))), 2)  # every rank deals alike
    assert shares(sizes, 8)[7] == []  # more ranks than files: some check nothing
    answers, errors = Exchange().map_files(sizes, lambda n: 1 / 0 if n == "scheduler.pt" else n.upper())
    assert answers["config.json"] == "CONFIG.JSON" and errors == {"scheduler.pt": "ZeroDivisionError: division by zero"}
