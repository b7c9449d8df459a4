"""SP failure worker (2 ranks, sp 2, pp 1): SP rank 1 dies (``die``) or hangs (``stuck``) before
its 3rd unit of step 2.  SP rank 0 is then inside an attention all-to-all: it must end with a
``RuntimeError`` naming the SP ranks, the step, the unit and the layer within the timeout; it
prints ``FAILED_AS_EXPECTED after <s>: <message>``, writes ``DONE_DIR/done.<rank>`` (when given:
``sp_dead_rank.py MODE TIMEOUT_S [DONE_DIR]``; a stuck rank leaves once it is there) and exits
with code 3.
"""
from __future__ import annotations

import sys
import time

from common import (
    LENGTHS,
    UNITS_DP1,
    InfiniPipeConfig,
    PipelineEngine,
    dist,
    exit_now,
    fail_at_forward,
    init,
    make_plan,
    random_batch,
    report_done,
)

from tests.helpers.reference import tiny_model

TIMEOUT_S = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
DONE_DIR = sys.argv[3] if len(sys.argv) > 3 else None


if __name__ == "__main__":
    mode = sys.argv[1]
    init()
    # Step 1 (first calls are slow on a loaded machine) runs with a generous timeout.
    engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(sp_degree=2, p2p_timeout_s=120))
    plan = make_plan(LENGTHS, UNITS_DP1, 1, engine.layers_per_stage)
    batch = random_batch(LENGTHS)
    engine.train_step(batch, plan=plan)
    engine.config.p2p_timeout_s = engine.sequence_parallel.timeout_s = TIMEOUT_S
    if dist.get_rank() == 1:
        fail_at_forward(engine, mode, 3, TIMEOUT_S, DONE_DIR)
    t0 = time.time()
    try:
        engine.train_step(batch, plan=plan)
    except RuntimeError as exc:
        print(f"[rank {dist.get_rank()}] FAILED_AS_EXPECTED after {time.time() - t0:.2f}s: {exc}",
              flush=True)
        report_done(DONE_DIR)
        exit_now(3)
    print(f"[rank {dist.get_rank()}] step 2 finished without error", flush=True)
