"""Which checkpoint a run resumes from: the newest intact one, and automatically after a restart.

Design: ``resume_from_checkpoint=True`` (or the string ``"True"``/``"true"`` a command line
passes) means the newest checkpoint under ``output_dir`` that a completed save published and
that still verifies (``publish.check_checkpoint``: every file of its manifest there with its
size and checksum); every newer folder passed over (a staging folder of a save that was killed,
a checkpoint with a truncated, missing or damaged file) is named with the reason.  Under
``torchrun --max-restarts N`` (and ``accelerate launch --max_restarts N``, which runs torchrun's
agent) a restarted job has ``TORCHELASTIC_RESTART_COUNT > 0``; with ``resume_on_restart`` (on by
default) its ``train()`` then resumes the same way without being asked, or starts from step 0
when no intact checkpoint exists yet.  An explicit path that fails verification is refused
naming the file.  Rank 0 lists the folders and reads the manifests, all ranks hash a share of
the files, and every rank takes rank 0's answer, so all ranks resume from one checkpoint even on
a filesystem whose listings lag.  A manifest from before checksums were recorded is checked by
size, with a warning saying so.
"""
from __future__ import annotations

import os
import re

from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.checkpoints.integrity import Exchange
from infinipipe_hf.trainer.checkpoints.publish import STAGING_PREFIX, Verdict, check_checkpoint

_CHECKPOINT = re.compile(r"^(?:" + re.escape(STAGING_PREFIX) + r")?checkpoint-(\d+)$")


def restart_count() -> int:
    """How many times the launcher restarted this job's workers (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def wants_newest(resume_from_checkpoint) -> bool:
    """``True``, or the string ``"True"``/``"true"`` (``TrainingArguments.resume_from_checkpoint``
    is a string, so ``--resume_from_checkpoint True`` arrives as one) that is not a folder."""
    if resume_from_checkpoint is True:
        return True
    return (isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.strip().lower() == "true"
            and not os.path.isdir(resume_from_checkpoint))


def _candidates(output_dir: str) -> list[tuple[str, bool]]:
    """``(folder, published)`` of every checkpoint folder under ``output_dir``, newest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), not name.startswith(STAGING_PREFIX), name))
    return [(os.path.join(output_dir, name), published) for _, published, name in sorted(found, reverse=True)]


def _newest(output_dir: str, ex: Exchange) -> tuple[str | None, list[str], Verdict | None]:
    skipped = []
    for path, published in ex.broadcast(lambda: _candidates(output_dir)):
        if not published:
            skipped.append(f"{path}: a save that did not finish (its staging folder; the next save of "
                           f"this step removes it)")
            continue
        verdict = check_checkpoint(path, ex)
        if verdict.problem is None:
            return path, skipped, verdict
        skipped.append(f"{path}: {verdict.problem}")
    return None, skipped, None


def newest_complete_checkpoint(output_dir: str, exchange: Exchange | None = None
                               ) -> tuple[str | None, list[str]]:
    """``(newest intact checkpoint or None, reasons for every newer folder passed over)``;
    collective when ``exchange`` spans several ranks."""
    path, skipped, _ = _newest(output_dir, exchange or Exchange())
    return path, skipped


def _agreed(output_dir: str) -> tuple[str | None, list[str], bool]:
    """Rank 0's answer on every rank: ``(path, skipped, whether its manifest has checksums)``."""
    ex = Exchange.current()
    path, skipped, verdict = _newest(output_dir, ex)
    summed = verdict is not None and verdict.manifest is not None and verdict.manifest.checksums is not None
    return ex.broadcast(lambda: (path, skipped, summed))


SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_setup_note(env=None) -> str | None:
    """Under ``--max-restarts`` without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torchrun's
    restarted workers read the previous attempt's addresses from the shared rendezvous store and
    fail in ``init_process_group``: what to set, or ``None``."""
    env = os.environ if env is None else env
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and env.get(SHARED_STORE_ENV) != "1":
        return (f"torchrun --max-restarts {env['TORCHELASTIC_MAX_RESTARTS']}: export {SHARED_STORE_ENV}=1 "
                f"before torchrun, or a restarted job fails to connect its ranks ('Gloo connectFullMesh "
                f"failed ... Connection refused', pytorch/pytorch#135712); see docs/recovery.md")
    return None


def _size_only_note(path: str) -> None:
    notices.warn(f"{path}: its manifest records file sizes only (saved before checksums were "
                 f"recorded); sizes were checked, the contents could not be")


def _explicit(path: str) -> str:
    verdict = check_checkpoint(path, Exchange.current())
    if verdict.problem is not None and verdict.has_manifest:
        raise ValueError(f"cannot resume from {path}: {verdict.problem}; pass an older checkpoint, or "
                         f"resume_from_checkpoint=True for the newest intact one")
    if not verdict.has_manifest:
        notices.warn(f"{path} has no epp_manifest.json (not saved by EPPTrainer, or its save did not "
                     f"finish): its files cannot be verified before they are loaded")
    elif verdict.manifest.checksums is None:
        _size_only_note(path)
    return path


def resolve_resume(resume_from_checkpoint, output_dir: str, resume_on_restart: bool):
    """The checkpoint ``train(resume_from_checkpoint=...)`` should load (``None``: none).

    Collective when a process group spans several ranks: every rank calls it."""
    note = restart_setup_note()
    if note and restart_count() == 0:
        notices.warn(note)
    newest = wants_newest(resume_from_checkpoint)
    if isinstance(resume_from_checkpoint, str) and not newest:
        return _explicit(resume_from_checkpoint)
    restarted = not resume_from_checkpoint and resume_on_restart and restart_count() > 0
    if not newest and not restarted:
        return None
    path, skipped, summed = _agreed(output_dir)
    for reason in skipped:
        notices.warn(f"resume: skipped {reason}")
    why = f"restart {restart_count()} of the job" if restarted else "resume_from_checkpoint=True"
    if path is None:
        if restarted:
            notices.info(f"{why}: no complete checkpoint in {output_dir}; training starts from step 0")
            return None
        raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint"
                         + (f" ({len(skipped)} passed over, see the warnings)" if skipped else ""))
    if not summed:
        _size_only_note(path)
    notices.info(f"{why}: resuming from {path}"
                 + (f" (the newest intact one; {len(skipped)} newer passed over)" if skipped else ""))
    return path
