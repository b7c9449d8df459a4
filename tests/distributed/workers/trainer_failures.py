"""EPPTrainer worker: one rank fails, every other rank's error names it (``trainer_failures.py MODE OUT_DIR``).

Modes (``pp_degree=2``; ``stopped_rank`` runs dp 2 x pp 2 on 4 ranks):
- ``corrupt_shard``: checkpoint-2's stage-1 shard has a damaged header (same size) and its
  manifest records sizes only, as saves did before checksums, so it passes; resuming, rank 1
  fails reading it;
- ``missing_optimizer_shard``: checkpoint-2 lacks ``optimizer.stage1.pt`` (and, like a checkpoint
  of another tool, its manifest); resuming, rank 1 fails loading it;
- ``callback_error``: a callback raises on rank 1 at the end of step 2;
- ``stopped_rank``: rank 3 stops itself (SIGSTOP) at the start of step 2, with the default
  ``ddp_timeout`` (30 minutes); a child process kills it only once every other rank reported, so
  the others must end on the stopped heartbeat, not on a lost connection.
Every rank that stops prints ``OUTCOME after <s>s: <error>``, writes ``OUT/reported/<rank>`` and
exits with code 3.
"""
from __future__ import annotations

import json
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
TIMEOUT_S = None if MODE == "stopped_rank" else 20
"""``ddp_timeout`` of the run (``None``: the default)."""
REPORTED = os.path.join(OUT, "reported")


def outcome(t0: float, exc: BaseException) -> None:
    print(f"[rank {dist.get_rank()}] OUTCOME after {time.time() - t0:.2f}s: {exc}", flush=True)
    sys.stdout.flush()
    open(os.path.join(REPORTED, str(dist.get_rank())), "w").close()
    os._exit(3)


def trainer(pp: int, **over):
    if TIMEOUT_S is not None:
        over["ddp_timeout"] = TIMEOUT_S
    return epp_trainer(SCENARIOS["base"], os.path.join(OUT, MODE), pp, planner=slicing_planner, **over)


def damage_checkpoint() -> None:
    ckpt = os.path.join(OUT, MODE, "checkpoint-2")
    if MODE == "corrupt_shard":
        with open(os.path.join(ckpt, "model-00002-of-00002.safetensors"), "r+b") as fh:
            fh.write(b"\xff" * 8)  # the header length: now absurd, the size unchanged
        manifest = os.path.join(ckpt, "epp_manifest.json")
        with open(manifest) as fh:
            sizes = json.load(fh)["files"]
        with open(manifest, "w") as fh:
            json.dump({"files": sizes}, fh)  # no checksums: the reader, not resume, finds the damage
    else:
        os.remove(os.path.join(ckpt, "optimizer.stage1.pt"))
        os.remove(os.path.join(ckpt, "epp_manifest.json"))


class Sabotage(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if MODE == "callback_error" and dist.get_rank() == 1 and state.global_step == 2:
            raise RuntimeError("boom from a callback on rank 1")

    def on_step_begin(self, args, state, control, **kw):
        if MODE == "stopped_rank" and dist.get_rank() == 3 and state.global_step == 1:
            others = dist.get_world_size() - 1
            subprocess.Popen(["sh", "-c", f"for i in $(seq 360); do [ $(ls {REPORTED} | wc -l) -ge {others} ] "
                                          f"&& break; sleep 0.5; done; kill -9 {os.getpid()}"])
            print(f"[rank 3] stopping myself (SIGSTOP) at step {state.global_step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    torch.set_num_threads(1)
    os.makedirs(REPORTED, exist_ok=True)
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
