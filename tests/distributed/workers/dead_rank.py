"""Failure worker (any world size >= 3, one pipeline): rank 1 dies (``die``: ``os._exit``), hangs
while alive (``stuck``) or is stopped with SIGSTOP (``stopped``) before its 3rd action; or it is
only slow (``slow``: busy for several peer-watch windows, then goes on).

``dead_rank.py MODE TIMEOUT_S [DONE_DIR]``.  Every other rank must end with a ``RuntimeError``
naming a peer, the step and the action; it prints ``FAILED_AS_EXPECTED after <s>: <message>``,
writes ``DONE_DIR/done.<rank>`` (when given) and exits with code 3.  ``die``/``stuck`` run step 2
with the short ``TIMEOUT_S`` (a ``stuck`` rank leaves once every other rank reported, given
``DONE_DIR``); ``stopped`` keeps the engine's default ``p2p_timeout_s`` (the peer
watch must end the wait long before it), and the stopped rank is killed only once every other
rank has reported (a child process watches ``DONE_DIR``), so no lost connection can help.
``slow`` shortens the peer watch's window to ``SLOW_WINDOW_S``; every rank must finish step 2
and print ``step 2 finished without error`` (a busy rank keeps beating: no false alarm).
"""
from __future__ import annotations

import os
import signal
import subprocess
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
    report_done,
    stay_until_reported,
    tiny_model,
)

TIMEOUT_S = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
DONE_DIR = sys.argv[3] if len(sys.argv) > 3 else None
SLOW_WINDOW_S = 2.0


def stop_until_the_others_reported() -> None:
    others = dist.get_world_size() - 1
    subprocess.Popen(["sh", "-c", f"for i in $(seq 240); do [ $(ls {DONE_DIR} | grep -c done) -ge {others} ] "
                                  f"&& break; sleep 0.5; done; kill -9 {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


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
            if mode == "stopped":
                stop_until_the_others_reported()
            if mode == "slow":
                end = time.time() + 4 * SLOW_WINDOW_S
                while time.time() < end:  # pure Python: holds the GIL but for its switch interval
                    pass
                return
            # past every peer's deadline (until each reported, with DONE_DIR), then go away
            stay_until_reported(DONE_DIR, dist.get_world_size() - 1, TIMEOUT_S * 3 + 2)
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
    if mode in ("stopped", "slow"):
        TIMEOUT_S = InfiniPipeConfig().p2p_timeout_s  # the default deadline
    if mode == "slow":
        from infinipipe_hf.runtime.parallel import peer_watch

        peer_watch.STALE_AFTER_S = SLOW_WINDOW_S
    engine.config.p2p_timeout_s = engine.executor.comm.timeout_s = TIMEOUT_S
    if dist.get_rank() == 1:
        sabotage(engine, mode)
    t0 = time.time()
    try:
        engine.train_step(batch, plan=plan)
    except RuntimeError as exc:
        print(f"[rank {dist.get_rank()}] FAILED_AS_EXPECTED after {time.time() - t0:.2f}s: {exc}",
              flush=True)
        report_done(DONE_DIR)
        exit_now(3)
    print(f"[rank {dist.get_rank()}] step 2 finished without error", flush=True)
