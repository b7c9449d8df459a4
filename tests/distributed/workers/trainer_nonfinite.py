"""EPPTrainer worker: a NaN gradient on one rank (``trainer_nonfinite.py MODE OUT_DIR``), pp 2 on 2 ranks.

After the backward of step 3, one element of an MLP gradient of rank 1 (stage 1) becomes NaN;
a checkpoint is saved every step.
- ``stop`` (the default policy): nothing catches the error; the test reads each rank's traceback
  and exit code, and the checkpoints left.
- ``skip``: training goes on; every rank prints ``[rank R] RESULT {json}`` with its weights
  before/after the skipped step, the scheduler's count, the logged counts; then rank 0 damages
  the newest checkpoint's stage-1 shard (same size) and both ranks resolve
  ``resume_from_checkpoint="True"`` together (the files are hashed by both ranks).
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import warnings

import torch
import torch.distributed as dist
from trainer_common import SCENARIOS, epp_trainer, slicing_planner
from transformers import TrainerCallback

from infinipipe_hf.trainer.checkpoints.resume import resolve_resume

MODE, OUT = sys.argv[1], sys.argv[2]
NAN_STEP, NAN_RANK = 3, 1


def inject_nan_gradient(trainer) -> None:
    train_step = trainer.training_step

    def training_step(*a, **kw):
        loss = train_step(*a, **kw)
        if trainer.state.global_step + 1 == NAN_STEP and dist.get_rank() == NAN_RANK:
            name, p = next((n, p) for n, p in trainer.engine.named_parameters() if "mlp.up_proj" in n)
            p.grad.view(-1)[0] = math.nan
            print(f"[rank {dist.get_rank()}] NaN put into the gradient of {name}", flush=True)
        return loss

    trainer.training_step = training_step


class Snapshots(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.after = trainer, {}

    def on_step_end(self, args, state, control, **kw):
        self.after[state.global_step] = {n: p.detach().clone() for n, p in self.trainer.engine.named_parameters()}


def skip_result(tr, snaps: Snapshots, seen) -> dict:
    before, skipped, after = (snaps.after[s] for s in (NAN_STEP - 1, NAN_STEP, NAN_STEP + 1))
    logs = [h for h in tr.state.log_history if "loss" in h]
    return {"steps": tr.state.global_step,
            "unchanged_by_skipped_step": all(torch.equal(before[n], skipped[n]) for n in before),
            "changed_by_next_step": any(not torch.equal(skipped[n], after[n]) for n in before),
            "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
            "scheduler_steps": tr.lr_scheduler.last_epoch,
            "grad_norm_is_nan": [math.isnan(h["grad_norm"]) for h in logs],
            "nonfinite_skipped_steps": [h.get("nonfinite_skipped_steps", 0) for h in logs],
            "warnings": [str(w.message) for w in seen if "is skipped" in str(w.message)]}


def damage_newest_and_resume(run_dir: str) -> tuple[str, list[str]]:
    shard = os.path.join(run_dir, "checkpoint-4", "model-00002-of-00002.safetensors")
    dist.barrier()
    if dist.get_rank() == 0:
        size = os.path.getsize(shard)
        with open(shard, "r+b") as fh:
            fh.seek(size - 64 * 1024)
            fh.write(random.Random(0).randbytes(64 * 1024))
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        path = resolve_resume("True", run_dir, True)
    return path, [str(w.message) for w in seen if "resume: skipped" in str(w.message)]


def main() -> None:
    torch.set_num_threads(1)
    run_dir = os.path.join(OUT, MODE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = epp_trainer(SCENARIOS["base"], run_dir, 2, planner=slicing_planner, ddp_timeout=60,
                         save_strategy="steps", save_steps=1, nonfinite_policy=MODE)
    inject_nan_gradient(tr)
    snaps = Snapshots(tr)
    tr.add_callback(snaps)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tr.train()  # stop: raises here on every rank
    result = skip_result(tr, snaps, seen)
    result["resumed"], result["resume_skipped"] = damage_newest_and_resume(run_dir)
    print(f"[rank {dist.get_rank()}] RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
