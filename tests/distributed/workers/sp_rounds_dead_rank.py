"""Failure inside an SP sub-group (4 ranks, gloo): a rank dies or hangs before its 2nd unit of step 2.

``sub2 die|stuck``: pp 1 x sp 4, rounds of a 2-rank unit (ranks 0-1) and two single-rank units;
rank 1 fails, so rank 0 is inside the sub-group's all-to-all: its error names that all-to-all and
the sub-group's ranks [0, 1]; ranks 2 and 3 finish their units and fail at the step's gradient
all-reduce.  ``single die|stuck``: pp 2 x sp 2, rounds of two single-rank units; rank 1 (stage 0,
SP rank 1) fails, so rank 3 (stage 1, SP rank 1) waits for its hidden states: its error names
rank 1.  Every surviving rank prints ``FAILED_AS_EXPECTED after <s>: <message>``, writes
``DONE_DIR/done.<rank>`` (when given: ``sp_rounds_dead_rank.py LAYOUT MODE TIMEOUT_S [DONE_DIR]``;
a stuck rank leaves once every survivor is there) and exits with 3.
"""
from __future__ import annotations

import sys
import time

from common import InfiniPipeConfig, PipelineEngine, dist, exit_now, fail_at_forward, init, report_done

from tests.distributed.round_plans import rounds_plan
from tests.helpers.reference import random_batch, tiny_model

LENGTHS = [9, 7, 5, 8, 6, 4, 3]
SUB2 = [[(0, 2, [(0, 0, 5)]), (2, 1, [(2, 0, 5)]), (3, 1, [(3, 0, 8)])],
        [(0, 2, [(0, 5, 9), (1, 0, 7)]), (2, 1, [(4, 0, 6)]), (3, 1, [(5, 0, 4), (6, 0, 3)])]]
SINGLE = [[(0, 1, [(0, 0, 5)]), (1, 1, [(2, 0, 5)])], [(0, 1, [(0, 5, 9), (1, 0, 7)]), (1, 1, [(3, 0, 8)])],
          [(0, 1, [(4, 0, 6)]), (1, 1, [(5, 0, 4), (6, 0, 3)])]]
TIMEOUT_S = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
DONE_DIR = sys.argv[4] if len(sys.argv) > 4 else None


if __name__ == "__main__":
    layout, mode = sys.argv[1], sys.argv[2]
    init()
    pp, sp, rounds = (1, 4, SUB2) if layout == "sub2" else (2, 2, SINGLE)
    # Step 1 (first calls are slow on a loaded machine) runs with a generous timeout.
    engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(pp_degree=pp, sp_degree=sp, p2p_timeout_s=120))
    plan = rounds_plan(LENGTHS, [rounds], pp=pp, sp=sp, layers_per_stage=engine.layers_per_stage)
    batch = random_batch(LENGTHS)
    engine.train_step(batch, plan=plan)
    engine.config.p2p_timeout_s = engine.sequence_parallel.timeout_s = TIMEOUT_S
    engine.executor.comm and setattr(engine.executor.comm, "timeout_s", TIMEOUT_S)
    engine.grad_sync.timeout_s = TIMEOUT_S
    if dist.get_rank() == 1:
        fail_at_forward(engine, mode, 2, TIMEOUT_S, DONE_DIR)
    t0 = time.time()
    try:
        engine.train_step(batch, plan=plan)
    except RuntimeError as exc:
        print(f"[rank {dist.get_rank()}] FAILED_AS_EXPECTED after {time.time() - t0:.2f}s: {exc}", flush=True)
        report_done(DONE_DIR)
        exit_now(3)
    print(f"[rank {dist.get_rank()}] step 2 finished without error", flush=True)
