"""Which checkpoint a run resumes from: the newest complete one, and automatically after a restart.

Design: ``resume_from_checkpoint=True`` means the newest checkpoint under ``output_dir`` that a
completed save published and that still verifies (``publish.verify_checkpoint``: every file of
its manifest there with its size); every newer folder passed over (a staging folder of a save
that was killed, a checkpoint with a truncated or missing file) is named with the reason.  Under
``torchrun --max-restarts N`` (and ``accelerate launch --max_restarts N``, which runs torchrun's
agent) a restarted job has ``TORCHELASTIC_RESTART_COUNT > 0``; with ``resume_on_restart`` (on by
default) its ``train()`` then resumes the same way without being asked, or starts from step 0
when no complete checkpoint exists yet.  Rank 0 decides and every rank takes its answer, so all
ranks resume from one checkpoint even on a filesystem whose listings lag.
"""
from __future__ import annotations

import os
import re

from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.checkpoints.publish import STAGING_PREFIX, verify_checkpoint

_CHECKPOINT = re.compile(r"^(?:" + re.escape(STAGING_PREFIX) + r")?checkpoint-(\d+)$")


def restart_count() -> int:
    """How many times the launcher restarted this job's workers (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def newest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """``(newest complete checkpoint or None, reasons for every newer folder passed over)``."""
    if not os.path.isdir(output_dir):
        return None, []
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), not name.startswith(STAGING_PREFIX), name))
    skipped = []
    for _, published, name in sorted(found, reverse=True):
        path = os.path.join(output_dir, name)
        if not published:
            skipped.append(f"{path}: a save that did not finish (its staging folder; the next save of "
                           f"this step removes it)")
            continue
        problem = verify_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path}: {problem}")
    return None, skipped


def _agreed(output_dir: str) -> tuple[str | None, list[str]]:
    """Rank 0's answer, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return newest_complete_checkpoint(output_dir)
    box = [newest_complete_checkpoint(output_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def resolve_resume(resume_from_checkpoint, output_dir: str, resume_on_restart: bool):
    """The checkpoint ``train(resume_from_checkpoint=...)`` should load (``None``: none)."""
    note = restart_setup_note()
    if note and restart_count() == 0:
        notices.warn(note)
    if isinstance(resume_from_checkpoint, str):
        problem = verify_checkpoint(resume_from_checkpoint)
        if problem is not None and "epp_manifest.json" not in problem:
            raise ValueError(f"cannot resume from {resume_from_checkpoint}: {problem}; pass an older "
                             f"checkpoint, or resume_from_checkpoint=True for the newest complete one")
        return resume_from_checkpoint
    restarted = not resume_from_checkpoint and resume_on_restart and restart_count() > 0
    if resume_from_checkpoint is not True and not restarted:
        return None
    path, skipped = _agreed(output_dir)
    for reason in skipped:
        notices.warn(f"resume: skipped {reason}")
    why = f"restart {restart_count()} of the job" if restarted else "resume_from_checkpoint=True"
    if path is None:
        if restarted:
            notices.info(f"{why}: no complete checkpoint in {output_dir}; training starts from step 0")
            return None
        raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint"
                         + (f" ({len(skipped)} passed over, see the warnings)" if skipped else ""))
    notices.info(f"{why}: resuming from {path}")
    return path
