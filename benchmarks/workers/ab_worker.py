"""One rank of the interleaved A/B benchmark (launched by torchrun from ``benchmarks/cpu/ab_runtime.py``).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.ab_worker SPEC.json

``SPEC.json``: ``{"model", "lengths", "schedules", "pp_degree", "profile", "memory_budget_gib",
"alternations", "seed", "out"}`` and optional ``"loss_chunk_tokens"``, ``"pin_cores"`` (rank r on
core r % cores).  Every schedule's engine is built first on the same weights and planned once
(one untimed step each); then each alternation times one step of every schedule, the order rotated
by one schedule per alternation, so slow phases of a shared machine fall on every schedule alike.  Rank 0 writes per schedule the timed step seconds (one per alternation, in order),
the simulated step, the plan, and every timed step's merged timeline events (stage, action, CPU
seconds, wall seconds, wait seconds) for the per-action breakdown.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def build(spec: dict, schedule: str, profile: str | None, shared=None):
    """The schedule's engine on ``profile`` (a path the engine loads), planning on ``shared`` cores."""
    import transformers

    from benchmarks.lib.shared_cores import engine_planner
    from infinipipe_hf import InfiniPipeConfig
    from infinipipe_hf.runtime.engine.engine import PipelineEngine

    torch.manual_seed(spec.get("seed", 0))
    cfg = transformers.LlamaConfig(**spec["model"])
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).float()
    return PipelineEngine(model, InfiniPipeConfig(
        pp_degree=spec["pp_degree"], schedule=schedule, profile=profile,
        memory_budget_gib=spec["memory_budget_gib"], p2p_timeout_s=600, seed_plan_on_rank0=True,
        loss_chunk_tokens=spec.get("loss_chunk_tokens", 4096)), planner=engine_planner(shared))


def timed_step(engine, batch, plan):
    for p in engine.parameters():
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    out = engine.train_step(batch, plan=plan)
    dist.barrier()
    return time.perf_counter() - t0, out


def main(spec_path: str) -> None:
    from benchmarks.lib.shared_cores import engine_profile

    spec = json.loads(Path(spec_path).read_text())
    profile, shared = engine_profile(spec.get("profile"), Path(spec_path).parent)  # the file's shared cores
    torch.set_num_threads(1)
    if spec.get("pin_cores"):
        from benchmarks.workers.runtime_worker import pin_to_core

        pin_to_core()  # before gloo starts its threads, so they share the rank's core
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(spec.get("seed", 0) + 1)
    vocab = spec["model"]["vocab_size"]
    batch = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in spec["lengths"]]
    engines, plans, results = {}, {}, {}
    for name in spec["schedules"]:
        engine = build(spec, name, profile, shared)
        try:
            _, out = timed_step(engine, batch, None)  # plans, warms up
        except ValueError as exc:  # no feasible plan at this budget: every rank agrees
            results[name] = {"error": str(exc)}
            continue
        engines[name], plans[name] = engine, out.plan
        results[name] = {"step_s": [], "order": [], "losses": [], "simulated_step_s": out.simulation.step_time_s,
                         "num_units": len(out.plan.units), "plan_info": dict(out.plan.info),
                         "plan": out.plan.to_dict(), "events": []}
    names = list(engines)
    for a in range(spec["alternations"]):
        order = names[a % len(names):] + names[:a % len(names)]
        for pos, name in enumerate(order):
            dt, out = timed_step(engines[name], batch, plans[name])
            results[name]["step_s"].append(dt)
            results[name]["order"].append(pos)
            results[name]["losses"].append(out.loss)
            merged = engines[name].gather_timeline(out.timeline)  # collective: every rank calls it
            results[name]["events"].append([[e.stage, e.action, e.cpu_s, e.duration_s, e.wait_s]
                                            for e in merged.events])
        if rank == 0:
            print(f"[rank 0] alternation {a}: " + ", ".join(f"{n} {results[n]['step_s'][-1]:.3f} s" for n in names),
                  flush=True)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
