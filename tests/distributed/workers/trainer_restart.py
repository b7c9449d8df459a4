"""EPPTrainer under ``torchrun --max-restarts 1``: a rank killed mid-run, the job resumes by itself
(``trainer_restart.py MODE OUT_DIR``; pp 2 on 2 processes, 6 steps, a checkpoint every 2 steps).

Modes:
- ``uninterrupted``: the reference run;
- ``kill_after_checkpoint``: on the first attempt rank 1 kills itself (SIGKILL) as step 3 begins,
  after checkpoint-2 was published;
- ``kill_during_save``: on the first attempt rank 1 kills itself in the middle of checkpoint-4's
  save (its optimizer shard written into the staging folder, nothing published).
torchrun restarts both ranks; ``train()`` is called exactly as on the first attempt and resumes
from the newest complete checkpoint (``resume_on_restart``).  Each rank writes its final stage
weights to ``OUT_DIR/MODE/final-rank<r>.safetensors`` and prints ``ATTEMPT <n> DONE``.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from trainer_common import SCENARIOS, RecordingEPPTrainer, epp_trainer, stage_state
from transformers import TrainerCallback

MODE, OUT = sys.argv[1], sys.argv[2]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _die(where: str) -> None:
    print(f"[rank {dist.get_rank()}] attempt {ATTEMPT}: killing myself {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _victim() -> bool:
    return ATTEMPT == 0 and dist.get_rank() == 1


class KillAfterCheckpoint(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        if MODE == "kill_after_checkpoint" and _victim() and state.global_step == 2:
            _die("as step 3 begins (checkpoint-2 is published)")


class KillingTrainer(RecordingEPPTrainer):
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if MODE == "kill_during_save" and _victim() and self.state.global_step == 4:
            _die(f"during the save of step 4 (in {output_dir})")


def main() -> None:
    torch.set_num_threads(1)
    out = os.path.join(OUT, MODE)
    scn = SCENARIOS["base"]
    tr = epp_trainer(scn, out, 2, max_steps=6, save_strategy="steps", save_steps=2)
    tr.__class__ = KillingTrainer  # the same trainer, with the save hook above
    tr.add_callback(KillAfterCheckpoint())
    tr.train()  # no resume argument: a restarted job resumes by itself
    state = {k: v.detach().contiguous() for k, v in stage_state(tr).items()}
    save_file(state, os.path.join(out, f"final-rank{dist.get_rank()}.safetensors"))
    dist.barrier()
    print(f"[rank {dist.get_rank()}] ATTEMPT {ATTEMPT} DONE at step {tr.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
