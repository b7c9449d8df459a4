"""Saving a training checkpoint atomically: written under a staging name, listed, then renamed.

Design: a process killed during a save (or a full disk) must never leave a ``checkpoint-N`` that a
resume picks up half written.  Every rank writes into ``tmp-checkpoint-N`` (a name HF's
``get_last_checkpoint`` and checkpoint rotation ignore); after a barrier rank 0 writes
``epp_manifest.json`` (every file with its size, what ``verify_checkpoint`` checks on resume) and
renames the folder to ``checkpoint-N`` (one atomic rename on a POSIX filesystem), then a second
barrier.  The steps between are HF's ``Trainer._save_checkpoint`` (model, optimizer, scheduler,
RNG states, trainer state, best-model bookkeeping, hub push, rotation).  A staging folder left by a
killed save is removed by the next save of the same step and named (skipped) by a resume.

Trade-off: the rename is atomic for one filesystem; a checkpoint folder on an object store is not
covered.
"""
from __future__ import annotations

import json
import os
import shutil

from infinipipe_hf.trainer.checkpoints.common import barrier

STAGING_PREFIX = "tmp-"
MANIFEST_NAME = "epp_manifest.json"


def staging_dir(final: str) -> str:
    """Where the checkpoint ``final`` is written before it is published."""
    head, tail = os.path.split(os.path.normpath(final))
    return os.path.join(head, STAGING_PREFIX + tail)


def _files(folder: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = os.path.getsize(path)
    return dict(sorted(out.items()))


def write_manifest(folder: str) -> None:
    """List every file of ``folder`` with its size in ``epp_manifest.json`` (written, then renamed)."""
    files = {k: v for k, v in _files(folder).items() if k != MANIFEST_NAME}
    tmp = os.path.join(folder, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST_NAME))


def verify_checkpoint(folder: str) -> str | None:
    """Why ``folder`` is not a complete checkpoint (naming the file), or ``None`` when every file
    its manifest lists is there with its size."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        return (f"it has no {MANIFEST_NAME}, so it was not published by a completed EPPTrainer save "
                f"(interrupted, or written by another tool)")
    try:
        with open(path) as fh:
            listed = json.load(fh)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path} is unreadable ({type(exc).__name__}: {exc})"
    for name, size in listed.items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        got = os.path.getsize(file)
        if got != size:
            return f"{file} has {got} bytes but {size} were saved (truncated or overwritten)"
    return None


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
    staging = staging_dir(final)
    if _is_main(trainer):
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    barrier()
    trainer.save_model(staging, _internal_call=True)
    _best_model(trainer, run_dir, final)
    _save_state(trainer, staging)
    barrier()
    if _is_main(trainer):
        write_manifest(staging)
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
