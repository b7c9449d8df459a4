"""How much planning one step ahead slows the training loop: planner on a thread vs in its process.

The loop is a small float32 MLP trained on CPU (many short torch calls, so it needs the GIL often,
as a real training loop's Python does).  It runs alone, then while 512-sequence batches are
planned back to back on a worker thread, then while they are planned in the planner process
(``infinipipe_hf/planner/worker.py``).  Rounds alternate so machine noise hits every variant;
the JSON keeps every round, the median slowdown and the worst.

    python -m benchmarks.planner.plan_ahead_gil [--rounds 5] [--steps 1500] [--out benchmarks/results/plan_ahead_gil.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.worker import PlannerProcess


def training_loop(steps: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return time.perf_counter() - start


def batch(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(int(rng.lognormvariate(7.0, 1.2)) + 16, 32768) for _ in range(512)]


def timed_with(planner: str, steps: int, request: dict) -> tuple[float, int]:
    """Loop time while ``planner`` ('none', 'thread', 'process') plans batches back to back."""
    if planner == "none":
        return training_loop(steps), 0
    stop, planned = threading.Event(), [0]
    process = PlannerProcess() if planner == "process" else None
    if process is not None:
        process.submit([64], request).result()  # started and imported before timing

    def keep_planning():
        seed = 0
        while not stop.is_set():
            seed += 1
            if process is None:
                plan_step(batch(seed), **request)
            else:
                process.submit(batch(seed), request).result()
            planned[0] += 1

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(keep_planning)
        time.sleep(0.2)
        elapsed = training_loop(steps)
        stop.set()
        job.result()
    if process is not None:
        process.close()
    return elapsed, planned[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out", default=str(RESULTS / "plan_ahead_gil.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = ModelSpec.from_config_dict(json.loads(config_path("llama2-7b").read_text()))
    request = dict(spec=spec, dims=ParallelDims(pp_degree=4), options=PlanOptions(memory_budget_bytes=80 * GIB))
    training_loop(a.steps // 5)  # warm-up: first-call costs out of the timed rounds
    rows = []
    for r in range(a.rounds):
        for planner in ("none", "thread", "process"):
            s, n = timed_with(planner, a.steps, request)
            rows.append({"round": r, "planner": planner, "loop_s": round(s, 4), "plans_during_loop": n})
            print(rows[-1], flush=True)
    alone = statistics.median(x["loop_s"] for x in rows if x["planner"] == "none")
    summary = {p: {"median_slowdown": round(statistics.median(x["loop_s"] for x in rows if x["planner"] == p) / alone, 3),
                   "worst_slowdown": round(max(x["loop_s"] for x in rows if x["planner"] == p) / alone, 3)}
               for p in ("thread", "process")}
    out = {"machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()}, "steps": a.steps,
           "loop_alone_median_s": alone, "summary": summary, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary), f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
