"""EPPTrainer with sequence parallelism: ``trainer_sp.py REF_DIR OUT_DIR PLANNER`` on 4 ranks.

Cases: pp 2 x sp 2 trains like the single-process HF ``Trainer`` (losses, grad norms, weights,
eval loss); dp 2 x sp 2 with tied embeddings the same, then ``save_model`` writes a checkpoint
``from_pretrained`` loads with the trained weights.  References come from REF_DIR (written by
the test process, ``trainer_common.reference_run``).  Prints ``CASE <name> OK`` and ``ALL OK``.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from trainer_common import (
    LOSS_RTOL,
    SCENARIOS,
    assert_close_list,
    assert_weights_match,
    dp_of,
    epp_trainer,
    load_reference,
    per_step,
    slicing_planner,
    stage_state,
)

warnings.filterwarnings("ignore", category=FutureWarning)
REF_DIR, OUT_DIR, PLANNER = sys.argv[1:4]
PLAN = slicing_planner if PLANNER == "slicing" else None


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def train_match(scn_name: str, *, pp: int, sp: int, tag: str, eval_set: bool = False,
                save: bool = False) -> None:
    t0 = time.time()
    scn = SCENARIOS[scn_name]
    ref, ref_w = load_reference(REF_DIR, scn_name, dp_of(pp, sp))
    out = os.path.join(OUT_DIR, tag)
    tr = epp_trainer(scn, out, pp, eval_set=eval_set, planner=PLAN, sp_degree=sp)
    assert tr.engine.layout.sp_degree == sp and tr.engine.sequence_parallel is not None
    tr.train()
    worst = assert_close_list(per_step(tr, scn), ref["losses"], f"{tag} losses", LOSS_RTOL)
    norms = [h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h]
    assert_close_list(norms, ref["grad_norms"], f"{tag} grad norms", 1e-9)
    assert_weights_match(stage_state(tr), ref_w, f"{tag} weights", LOSS_RTOL)
    msg = ""
    if eval_set:
        ev = tr.evaluate()["eval_loss"]
        assert abs(ev - ref["eval_loss"]) <= LOSS_RTOL * abs(ref["eval_loss"]), (ev, ref["eval_loss"])
        msg = f" eval_loss={ev:.12f}"
    if save:
        final = os.path.join(out, "final")
        tr.save_model(final)
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64)
            assert_weights_match(loaded.state_dict(), ref_w, f"{tag} from_pretrained weights")
        dist.barrier()
        msg += " saved+loaded"
    log(f"CASE {tag} OK loss_rel={worst:.1e}{msg} {time.time() - t0:.1f}s")


if __name__ == "__main__":
    torch.set_num_threads(1)
    train_match("base", pp=2, sp=2, tag="pp2sp2_base_eval", eval_set=True)
    train_match("tied", pp=1, sp=2, tag="dp2sp2_tied_save", save=True)
    train_match("long_docs", pp=1, sp=2, tag="dp2sp2_long_docs")
    print(f"[rank {dist.get_rank()}] planner={PLANNER} ALL OK", flush=True)
