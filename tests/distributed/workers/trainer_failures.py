"""EPPTrainer worker: one rank fails, every other rank's error names it (``trainer_failures.py MODE OUT_DIR``).

Modes (``pp_degree=2``; ``stopped_rank`` runs dp 2 x pp 2 on 4 ranks):
- ``corrupt_shard``: checkpoint-2's stage-1 shard has a damaged header (same size, so the
  manifest passes); resuming, rank 1 fails reading it;
- ``missing_optimizer_shard``: checkpoint-2 lacks ``optimizer.stage1.pt`` (and, like a checkpoint
  of another tool, its manifest); resuming, rank 1 fails loading it;
- ``callback_error``: a callback raises on rank 1 at the end of step 2;
- ``stopped_rank``: rank 3 stops itself (SIGSTOP) at the start of step 2 (a child process kills it
  later).
Every rank that stops prints ``OUTCOME after <s>s: <error>`` and exits with code 3.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
from trainer_common import SCENARIOS, epp_trainer, slicing_planner
from transformers import TrainerCallback

warnings.filterwarnings("ignore")
MODE, OUT = sys.argv[1], sys.argv[2]
TIMEOUT_S = 10 if MODE == "stopped_rank" else 20


def outcome(t0: float, exc: BaseException) -> None:
    print(f"[rank {dist.get_rank()}] OUTCOME after {time.time() - t0:.2f}s: {exc}", flush=True)
    sys.stdout.flush()
    os._exit(3)


def trainer(pp: int, **over):
    return epp_trainer(SCENARIOS["base"], os.path.join(OUT, MODE), pp, planner=slicing_planner,
                       ddp_timeout=TIMEOUT_S, **over)


def damage_checkpoint() -> None:
    ckpt = os.path.join(OUT, MODE, "checkpoint-2")
    if MODE == "corrupt_shard":
        with open(os.path.join(ckpt, "model-00002-of-00002.safetensors"), "r+b") as fh:
            fh.write(b"\xff" * 8)  # the header length: now absurd, the size unchanged
    else:
        os.remove(os.path.join(ckpt, "optimizer.stage1.pt"))
        os.remove(os.path.join(ckpt, "epp_manifest.json"))


class Sabotage(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if MODE == "callback_error" and dist.get_rank() == 1 and state.global_step == 2:
            raise RuntimeError("boom from a callback on rank 1")

    def on_step_begin(self, args, state, control, **kw):
        if MODE == "stopped_rank" and dist.get_rank() == 3 and state.global_step == 1:
            subprocess.Popen(["sh", "-c", f"sleep 20; kill -9 {os.getpid()}"])
            print(f"[rank 3] stopping myself (SIGSTOP) at step {state.global_step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    torch.set_num_threads(1)
    if MODE in ("corrupt_shard", "missing_optimizer_shard"):
        trainer(2, max_steps=2, save_strategy="steps", save_steps=2).train()
        dist.barrier()
        if dist.get_rank() == 0:
            damage_checkpoint()
        dist.barrier()
        tr, resume = trainer(2), os.path.join(OUT, MODE, "checkpoint-2")
    else:
        tr, resume = trainer(2), None
        tr.add_callback(Sabotage())
    t0 = time.time()
    try:
        tr.train(resume_from_checkpoint=resume)
    except Exception as exc:
        outcome(t0, exc)
    print(f"[rank {dist.get_rank()}] finished without error", flush=True)


if __name__ == "__main__":
    main()
