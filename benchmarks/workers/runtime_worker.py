"""One rank of a CPU/gloo benchmark run through ``PipelineEngine`` (launched by torchrun).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.runtime_worker SPEC.json

``SPEC.json``: ``{"model": {LlamaConfig kwargs}, "lengths": [...], "schedules": [...],
"pp_degree": 2, "profile": PATH | null, "memory_budget_gib": x | {schedule: x} | null, "warmup": 1, "steps": 2,
"seed": 0, "out": PATH}`` (optional ``max_tokens_per_unit``, ``num_slices``, ``sp_degree``,
``loss_chunk_tokens``, ``pin_cores``: pin rank r to core r % cores, ``memory_probe``, ``speed_probe``: unit shapes every rank times just
before and just after each schedule's timed steps, see :func:`speed_probe`;
``speed_probe_every_step``: probe before every timed step too, so that each step is bracketed by
two probes).  For each schedule
the worker builds the same random model (same seed, so the same weights), runs ``warmup``
untimed steps and ``steps`` timed steps on the same batch (gradients zeroed between steps, no
optimizer: weights never change, so every step's loss is the same number).  The plan of the
first step is reused by the later ones (a solver time limit could otherwise plan a timed step
differently from the simulated one, and planning is not pipeline time).  Every timed step's merged timeline is gathered (its span is the
executed pipeline's step time), and the cores other processes used meanwhile (``/proc/stat``'s
busy time less this run's processes' CPU time, over the step's wall time).  With ``memory_probe`` one more step runs under the CPU
allocator's event probe (``profiling/memory_events.py``): each rank's peak is the bytes of its
stage's weights and buffers (alive before the step) plus the probe's peak above them.  Rank 0
writes one JSON with per-schedule losses, wall times, timelines, plan and peaks.  Design: one launch for all schedules because
process start-up and gloo rendezvous cost more than a small step; each rank pins one thread so the
two ranks do not fight over the cores and timings mean what the cost model assumes.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used (``/proc/stat``), 0 where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def pin_to_core() -> int:
    """Pin this rank (and the threads it starts later: gloo's) to core ``LOCAL_RANK % cores``, as
    the simulator assumes with ``pinned_ranks`` (``benchmarks/lib/shared_cores.py``).

    Why: with more ranks than cores, the kernel moves ranks between cores and may leave a core idle
    while a woken rank waits on the other (wake-up placement, load balancing); on this 2-core VM
    an unpinned pp 4 step took 3.8-7.8% longer than its measured actions replayed with ideal
    sharing of both cores, a pinned one 1.6-4.7% (docs/simulator_vs_real.md).  Pinned, each core
    is shared by its own ranks only, which the replay models."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def budget_gib(spec: dict, schedule: str) -> float | None:
    """``memory_budget_gib``: one number for every schedule, or a dict schedule -> GiB."""
    b = spec.get("memory_budget_gib")
    return b.get(schedule) if isinstance(b, dict) else b


def _resident_bytes(module) -> int:
    """Bytes of the distinct storages of a module's parameters and buffers."""
    seen = {}
    for t in list(module.parameters()) + list(module.buffers()):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return int(sum(seen.values()))


def memory_probe_step(engine, batch, plan) -> list[dict]:
    """One more step under the allocator-event probe; every rank's peak, gathered on all ranks."""
    from infinipipe_hf.profiling.memory_events import MemoryProbe, window_peaks

    for p in engine.parameters():
        p.grad = None
    resident = _resident_bytes(engine.stage)
    dist.barrier()
    with MemoryProbe() as probe:
        out = engine.train_step(batch, plan=plan)
    lay = engine.layout
    # The allocator's clock and the timeline's are both wall clocks: name the action at the peak.
    at = [e.action for e in out.timeline.events if e.start_s <= probe.trace.peak_time <= e.end_s]
    mine_events = [e for e in out.timeline.events if e.rank == engine.layout.rank]
    per_action = window_peaks(probe.events, [(e.start_s, e.end_s) for e in mine_events])
    mine = {"rank": lay.rank, "stage": lay.stage_index, "sp_rank": getattr(lay, "sp_rank", 0),
            "resident_bytes": resident, "step_peak_above_resident_bytes": probe.trace.peak_bytes,
            "peak_bytes": resident + probe.trace.peak_bytes, "allocator_events": probe.trace.num_events,
            "peak_action": at[0] if at else None,
            "action_peaks": {e.action: resident + b for e, b in zip(mine_events, per_action)}}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def speed_probe(spec: dict) -> list[list[dict]] | None:
    """Every rank times ``spec["speed_probe"]`` (``[[segments, level], ...]``, fit shapes of the
    profile) through ``benchmarks.lib.runtime_rows`` at once, as the ranks of a step share the cores;
    the rows of all ranks.  ``sim_vs_real`` turns them into the machine's speed relative to the
    profile around the schedule's steps (``benchmarks.lib.runtime_fit.speed_factor``)."""
    import transformers

    from benchmarks.lib.runtime_rows import UnitCase, measure_unit_rows

    shapes = spec.get("speed_probe")
    if not shapes:
        return None
    torch.manual_seed(spec.get("seed", 0))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["model"])).float()
    cases = [UnitCase(tuple(tuple(seg) for seg in segments), level) for segments, level in shapes]
    dist.barrier()
    rows = measure_unit_rows(model, cases, repeat=spec.get("speed_probe_repeat", 5))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return parts


def main(spec_path: str) -> None:
    import transformers

    from benchmarks.lib.shared_cores import engine_planner, engine_profile
    from infinipipe_hf import InfiniPipeConfig
    from infinipipe_hf.runtime.engine.engine import PipelineEngine

    spec = json.loads(Path(spec_path).read_text())
    # A profile file with the shared-cores keys: the engine plans on those cores.
    profile, shared = engine_profile(spec.get("profile"), Path(spec_path).parent)
    torch.set_num_threads(1)
    if spec.get("pin_cores"):
        pin_to_core()
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
            pp_degree=spec["pp_degree"], sp_degree=spec.get("sp_degree", 1), schedule=schedule,
            profile=profile, memory_budget_gib=budget_gib(spec, schedule), p2p_timeout_s=600,
            loss_chunk_tokens=spec.get("loss_chunk_tokens", 4096), seed_plan_on_rank0=True,
            max_tokens_per_unit=spec.get("max_tokens_per_unit"), num_slices=spec.get("num_slices"),
            **({"sp_rounds": spec["sp_rounds"]} if spec.get("sp_rounds") is not None and schedule == "epp" else {})),
            planner=engine_planner(shared))
        times, spans, timelines, losses, background, out, plan, sim = [], [], [], [], [], None, None, None
        process_cpu, main_thread_cpu = [], []
        # Speed probes: one before the first timed step (and, with ``speed_probe_every_step``,
        # one before every timed step), one after the last, so each timed step can be paired
        # with the machine's speed measured right around it.
        every_step = bool(spec.get("speed_probe_every_step"))
        probes = [] if every_step else [speed_probe(spec)]
        warmup = spec.get("warmup", 1)
        for i in range(warmup + spec.get("steps", 2)):
            if every_step and i >= warmup:
                probes.append(speed_probe(spec))
            for p in engine.parameters():
                p.grad = None
            dist.barrier()
            busy0, cpu0, thread0 = machine_busy_s(), time.process_time(), time.thread_time()
            t0 = time.perf_counter()
            try:
                out = engine.train_step(batch, plan=plan)
            except ValueError as exc:  # no feasible plan: the planner is deterministic, every rank agrees
                if rank == 0:
                    results[schedule] = {"error": str(exc)}
                    print(f"[rank 0] {schedule}: {exc}", flush=True)
                out = None
                break
            dist.barrier()
            dt = time.perf_counter() - t0
            busy = machine_busy_s() - busy0
            ours = [None] * dist.get_world_size()
            dist.all_gather_object(ours, time.process_time() - cpu0)
            mains = [None] * dist.get_world_size()
            dist.all_gather_object(mains, time.thread_time() - thread0)
            if plan is None:
                plan, sim = out.plan, out.simulation
            if i >= warmup:
                times.append(dt)
                losses.append(out.loss)
                # Cores other processes used meanwhile: the machine's busy time less this run's.
                background.append(max(busy - sum(ours), 0.0) / dt)
                process_cpu.append(ours)
                main_thread_cpu.append(mains)
                merged = engine.gather_timeline(out.timeline)
                spans.append(merged.span_s)
                timelines.append(merged.relative().to_dict())
        if out is None:
            continue
        # Again after the timed steps: the machine's speed drifts within a run too.
        probes.append(speed_probe(spec))
        probes = [p for p in probes if p is not None]
        peaks = memory_probe_step(engine, batch, plan) if spec.get("memory_probe") else None
        if rank == 0:
            results[schedule] = {
                "losses": losses, "step_wall_s": times, "step_span_s": spans, "background_cores": background,
                # Per timed step, per rank: the process's CPU seconds (every thread: gloo's
                # included) and the main thread's; against the actions' CPU seconds they show
                # the work the executor does between actions and the transport threads' share.
                "process_cpu_s": process_cpu, "main_thread_cpu_s": main_thread_cpu,
                "timeline": timelines[-1], "timelines": timelines, "timeline_span_s": spans[-1],
                "plan": plan.to_dict(), "plan_info": dict(plan.info),
                "simulated_step_s": sim.step_time_s if sim is not None else None,
                "simulated_peak_memory_bytes": list(sim.peak_memory_bytes) if sim is not None else None,
                "num_units": len(plan.units), "num_pipelines": plan.num_pipelines,
                **({"measured_peak_memory": peaks} if peaks is not None else {}),
                # ``speed_probe``: every rank's rows of every probe (the pooled factor);
                # ``speed_probes``: per probe, in order (before each timed step with
                # ``speed_probe_every_step``, and after the last).
                **({"speed_probe": [rows for pr in probes for rows in pr], "speed_probes": probes,
                    "speed_probe_every_step": every_step} if probes else {}),
            }
            print(f"[rank 0] {schedule}: {len(plan.units)} units, loss {losses[-1]:.10f}, "
                  f"steps {['%.3f' % t for t in times]} s", flush=True)
        del engine, model
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
