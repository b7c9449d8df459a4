"""Saving a training checkpoint atomically and checkably: staged, checksummed, then renamed.

Design: a process killed during a save (or a full disk) must never leave a ``checkpoint-N`` that a
resume picks up half written, and a file damaged later must never be loaded.  Every rank writes
into ``tmp-checkpoint-N`` (a name HF's ``get_last_checkpoint`` and checkpoint rotation ignore);
after a barrier rank 0 lists the files, every rank hashes a share of them, and rank 0 writes
``epp_manifest.json`` (every file with its size and SHA-256, ``manifest.py``) and renames the
folder to ``checkpoint-N`` (one atomic rename on a POSIX filesystem), then a second barrier.
The steps between are HF's ``Trainer._save_checkpoint`` (model, optimizer, scheduler, RNG
states, trainer state, best-model bookkeeping, hub push, rotation).  Before anything is written
the ranks check together that the parameters are finite: a NaN model is never saved, so it can
never rotate a good checkpoint out.  ``check_checkpoint`` is the other half: the same files,
sizes and checksums, checked on resume by all ranks together.  A staging folder left by a killed
save is removed by the next save of the same step and named (skipped) by a resume.

Trade-off: the rename is atomic for one filesystem; a checkpoint folder on an object store is not
covered.  Hashing reads the checkpoint once more (shared out over the ranks).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from infinipipe_hf.trainer.checkpoints.common import barrier
from infinipipe_hf.trainer.checkpoints.integrity import Exchange
from infinipipe_hf.trainer.checkpoints.manifest import (
    MANIFEST_NAME,
    Manifest,
    file_checksum,
    file_problem,
    list_files,
    read_manifest,
    write_manifest,
)
from infinipipe_hf.trainer.nonfinite import check_parameters

STAGING_PREFIX = "tmp-"
_NAMED = 3
"""Damaged files named one by one in a verdict; the rest are counted."""

__all__ = ["MANIFEST_NAME", "STAGING_PREFIX", "Verdict", "check_checkpoint", "save_checkpoint",
           "staging_dir", "verify_checkpoint", "write_manifest"]


def staging_dir(final: str) -> str:
    """Where the checkpoint ``final`` is written before it is published."""
    head, tail = os.path.split(os.path.normpath(final))
    return os.path.join(head, STAGING_PREFIX + tail)


@dataclass(frozen=True)
class Verdict:
    """What checking one checkpoint folder found."""

    problem: str | None
    """Why the folder must not be resumed from (naming the files), or ``None``."""
    manifest: Manifest | None
    """Its manifest, when one could be read."""
    has_manifest: bool
    """Whether the folder has a manifest at all (a checkpoint of another tool has none)."""


def _read(folder: str) -> tuple[Manifest | str, bool]:
    return read_manifest(folder), os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def check_checkpoint(folder: str, exchange: Exchange | None = None) -> Verdict:
    """Every file the manifest lists: there, with its size and (when recorded) its checksum.

    Collective with an ``exchange`` over several ranks (all of them call it): rank 0 reads the
    manifest, the files are checked by all ranks, and every rank returns the same verdict."""
    ex = exchange or Exchange()
    manifest, exists = ex.broadcast(lambda: _read(folder))
    if isinstance(manifest, str):
        return Verdict(manifest, None, exists)
    answers, errors = ex.map_files(manifest.files, lambda name: file_problem(folder, name, manifest))
    problems = [f"{os.path.join(folder, n)} cannot be checked ({errors[n]})" if n in errors else answers[n]
                for n in manifest.files if n in errors or answers.get(n)]
    if not problems:
        return Verdict(None, manifest, True)
    more = len(problems) - _NAMED
    text = "; ".join(problems[:_NAMED]) + (f"; and {more} more damaged files" if more > 0 else "")
    return Verdict(text, manifest, True)


def verify_checkpoint(folder: str, exchange: Exchange | None = None) -> str | None:
    """Why ``folder`` is not a complete, intact checkpoint (naming the files), or ``None`` when
    every file its manifest lists is there with its size and checksum (``check_checkpoint``)."""
    return check_checkpoint(folder, exchange).problem


def _publish_manifest(staging: str, main: bool) -> None:
    """Collective: list the staging folder (rank 0), hash its files (shared out over the ranks),
    write the manifest (rank 0)."""
    ex = Exchange.current()
    files = ex.broadcast(lambda: list_files(staging))
    sums, errors = ex.map_files(files, lambda name: file_checksum(os.path.join(staging, name)))
    if errors:  # the same answers on every rank: every rank stops here
        name = sorted(errors)[0]
        raise OSError(f"cannot checksum {os.path.join(staging, name)} of the checkpoint being saved "
                      f"({errors[name]}); the checkpoint is not published")
    if main:
        write_manifest(staging, files, sums)


def _is_main(trainer) -> bool:
    return trainer.args.process_index == 0


def _best_model(trainer, run_dir: str, final: str) -> None:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

    args, state = trainer.args, trainer.state
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if best == final or os.path.exists(best):
            state.best_model_checkpoint = best


def _save_state(trainer, staging: str) -> None:
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState

    if not trainer.args.save_only_model:
        trainer._save_optimizer_and_scheduler(staging)
        trainer._save_scaler(staging)
        trainer._save_rng_state(staging)
    if trainer.args.should_save:
        state = trainer.state
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                   if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))


def save_checkpoint(trainer, trial=None) -> str:
    """Collective: HF's checkpoint save into a staging folder, published by one rename; returns
    the published folder."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
    final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    check_parameters(trainer.engine, final)  # collective; before the staging folder exists
    staging = staging_dir(final)
    if _is_main(trainer):
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    barrier()
    trainer.save_model(staging, _internal_call=True)
    _best_model(trainer, run_dir, final)
    _save_state(trainer, staging)
    barrier()
    _publish_manifest(staging, _is_main(trainer))
    if _is_main(trainer):
        if os.path.isdir(final):  # the same step saved again (a restarted job): replace it
            shutil.rmtree(final)
        os.replace(staging, final)
    barrier()
    if trainer.args.push_to_hub:
        trainer._push_from_checkpoint(final)
    if trainer.args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    return final
