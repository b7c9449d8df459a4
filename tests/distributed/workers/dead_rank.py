"""Failure worker (any world size >= 3, one pipeline): rank 1 dies (``die``: ``os._exit``) or hangs (``stuck``) before its 3rd action.

Every other rank must end with a ``RuntimeError`` naming a peer, the step and the action within the
p2p timeout; it prints ``FAILED_AS_EXPECTED after <s>: <message>`` and exits with code 3.
"""
from __future__ import annotations

import os
import sys
import time

from common import (
    LENGTHS,
    UNITS_DP1,
    InfiniPipeConfig,
    PipelineEngine,
    dist,
    exit_now,
    init,
    make_plan,
    random_batch,
    tiny_model,
)

TIMEOUT_S = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0


def sabotage(engine: PipelineEngine, mode: str) -> None:
    calls = {"n": 0}
    runner = engine.runner
    fwd, bwd = runner.forward, runner.backward

    def maybe_fail():
        calls["n"] += 1
        if calls["n"] == 3:
            print(f"[rank {dist.get_rank()}] sabotage: {mode}", flush=True)
            if mode == "die":
                os._exit(17)
            time.sleep(TIMEOUT_S * 3 + 2)  # past every peer's deadline, then go away
            os._exit(0)

    runner.forward = lambda *a, **k: (maybe_fail(), fwd(*a, **k))[1]
    runner.backward = lambda *a, **k: (maybe_fail(), bwd(*a, **k))[1]


if __name__ == "__main__":
    mode = sys.argv[1]
    init()
    pp = dist.get_world_size()
    # Step 1 (first calls are slow on a loaded machine) runs with a generous timeout; the short
    # one under test applies from step 2 on.
    engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(pp_degree=pp, p2p_timeout_s=120))
    plan = make_plan(LENGTHS, UNITS_DP1, pp, engine.layers_per_stage)
    batch = random_batch(LENGTHS)
    engine.train_step(batch, plan=plan)  # step 1 succeeds everywhere
    engine.config.p2p_timeout_s = engine.executor.comm.timeout_s = TIMEOUT_S
    if dist.get_rank() == 1:
        sabotage(engine, mode)
    t0 = time.time()
    try:
        engine.train_step(batch, plan=plan)
    except RuntimeError as exc:
        print(f"[rank {dist.get_rank()}] FAILED_AS_EXPECTED after {time.time() - t0:.2f}s: {exc}",
              flush=True)
        exit_now(3)
    print(f"[rank {dist.get_rank()}] step 2 finished without error", flush=True)
