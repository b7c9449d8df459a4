"""EPPTrainer with ``pp_degree="auto"``: ``trainer_auto.py REF_DIR OUT_DIR`` on 2 ranks.

Cases: the search's choice is the same on every rank and covers the world, and training with it
matches the single-process HF ``Trainer`` (losses, weights); restricted to ``sp_degree=2`` it
picks sp 2 and matches too; restricted to ``sp_degree=4`` no layout of 2 processes can run and
every rank raises the same error (no hang).  Prints ``CASE <name> OK`` and ``ALL OK``.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch.distributed as dist
from trainer_common import (
    LOSS_RTOL,
    SCENARIOS,
    assert_close_list,
    assert_weights_match,
    epp_trainer,
    load_reference,
    per_step,
    stage_state,
)

warnings.filterwarnings("ignore")
REF_DIR, OUT_DIR = sys.argv[1:3]


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def auto_match(tag: str, **kw) -> tuple:
    scn = SCENARIOS["base"]
    tr = epp_trainer(scn, os.path.join(OUT_DIR, tag), "auto", **kw)
    a = tr.args
    ref, ref_w = load_reference(REF_DIR, "base", a.dp_degree)  # the batches depend on dp
    layout = (a.pp_degree, a.sp_degree, a.dp_degree, a.shard)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, layout)
    assert len(set(everyone)) == 1, everyone
    assert a.pp_degree * a.sp_degree * a.dp_degree == dist.get_world_size(), layout
    lay = tr.engine.layout
    assert (lay.pp_degree, lay.sp_degree, lay.dp_degree) == layout[:3], (lay, layout)
    tr.train()
    worst = assert_close_list(per_step(tr, scn), ref["losses"], f"{tag} losses", LOSS_RTOL)
    assert_weights_match(stage_state(tr), ref_w, f"{tag} weights", LOSS_RTOL)
    log(f"CASE {tag} OK layout={layout} worst_rel_err={worst:.2e}")
    return layout


def no_layout() -> None:
    try:
        epp_trainer(SCENARIOS["base"], os.path.join(OUT_DIR, "none"), "auto", sp_degree=4)
    except ValueError as exc:
        assert "pp_degree='auto': no parallel layout of 2 GPUs" in str(exc), str(exc)
        log("CASE auto_no_layout OK")
        return
    raise AssertionError("expected a ValueError")


if __name__ == "__main__":
    auto_match("auto_base", sp_degree="auto", shard="auto")
    assert auto_match("auto_sp2", sp_degree=2)[1] == 2
    no_layout()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
