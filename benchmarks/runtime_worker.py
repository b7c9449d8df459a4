"""One rank of a CPU/gloo benchmark run through ``PipelineEngine`` (launched by torchrun).

    torchrun --standalone --nproc_per_node 2 benchmarks/runtime_worker.py SPEC.json

``SPEC.json``: ``{"model": {LlamaConfig kwargs}, "lengths": [...], "schedules": [...],
"pp_degree": 2, "profile": PATH | null, "memory_budget_gib": x | null, "warmup": 1, "steps": 2,
"seed": 0, "out": PATH}`` (optional ``max_tokens_per_unit``, ``num_slices``).  For each schedule the worker builds the same random model (same seed,
so the same weights), runs ``warmup`` untimed steps and ``steps`` timed steps on the same batch
(gradients zeroed between steps, no optimizer: weights never change, so every step's loss is the
same number), gathers the merged timeline of the last timed step, and rank 0 writes one JSON with
per-schedule losses, wall times, timeline and plan.  Design: one launch for all schedules because
process start-up and gloo rendezvous cost more than a small step; each rank pins one thread so the
two ranks do not fight over the cores and timings mean what the cost model assumes.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(spec_path: str) -> None:
    import transformers

    from infinipipe_hf import InfiniPipeConfig
    from infinipipe_hf.runtime.engine import PipelineEngine

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(spec.get("seed", 0) + 1)
    vocab = spec["model"]["vocab_size"]
    batch = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in spec["lengths"]]
    results = {}
    for schedule in spec["schedules"]:
        torch.manual_seed(spec.get("seed", 0))
        cfg = transformers.LlamaConfig(**spec["model"])
        cfg._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(cfg).float()
        engine = PipelineEngine(model, InfiniPipeConfig(
            pp_degree=spec["pp_degree"], schedule=schedule, profile=spec.get("profile"),
            memory_budget_gib=spec.get("memory_budget_gib"), p2p_timeout_s=600,
            loss_chunk_tokens=spec.get("loss_chunk_tokens", 4096),
            max_tokens_per_unit=spec.get("max_tokens_per_unit"), num_slices=spec.get("num_slices")))
        times, losses, out = [], [], None
        for i in range(spec.get("warmup", 1) + spec.get("steps", 2)):
            for p in engine.parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            try:
                out = engine.train_step(batch)
            except ValueError as exc:  # no feasible plan: the planner is deterministic, every rank agrees
                if rank == 0:
                    results[schedule] = {"error": str(exc)}
                    print(f"[rank 0] {schedule}: {exc}", flush=True)
                break
            dist.barrier()
            dt = time.perf_counter() - t0
            if i >= spec.get("warmup", 1):
                times.append(dt)
                losses.append(out.loss)
        if out is None:
            continue
        timeline = engine.gather_timeline(out.timeline)
        sim = out.simulation
        if rank == 0:
            results[schedule] = {
                "losses": losses, "step_wall_s": times,
                "timeline": timeline.relative().to_dict(),
                "timeline_span_s": timeline.span_s,
                "plan": out.plan.to_dict(), "plan_info": dict(out.plan.info),
                "simulated_step_s": sim.step_time_s if sim is not None else None,
                "simulated_peak_memory_bytes": list(sim.peak_memory_bytes) if sim is not None else None,
                "num_units": len(out.plan.units), "num_pipelines": out.plan.num_pipelines,
            }
            print(f"[rank 0] {schedule}: {len(out.plan.units)} units, loss {losses[-1]:.10f}, "
                  f"steps {['%.3f' % t for t in times]} s", flush=True)
        del engine, model
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
