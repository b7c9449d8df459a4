"""The longest sequence one GPU trains with the host tier, measured against the planner's prediction.

    python -m benchmarks.gpu.offload_reach_gpu [--state-offload optimizer] [--memory-budget-gib G]
        [--host-memory-gib H] [--max-length N] [--out offload_reach_gpu.json]
    python -m benchmarks.gpu.offload_reach_gpu --tiny --device cpu --dtype fp32    # dry run, seconds

A Llama-shape model (default Llama-3.2-1B's shape, random weights, bf16, fused AdamW) on one GPU
with its optimizer states in host memory (``--state-offload optimizer``, or ``states``: every
state), planned with the machine's host memory less ``--host-margin`` (or ``--host-memory-gib``).
The layout search's longest-length helper (``planner/layout_search/longest.py``: power-of-two
search and bisection on ``plan_step``'s candidate search, then ``plan_step`` confirms) finds the
longest single sequence the planner says trains with the host tier; the engine runs ``--steps``
steps at it.  The row reports measured against predicted: device peak (``max_memory_allocated``
against the simulator's peak), host peak (the engine's ``host_tier`` accounting, plus the
parameters, gradients and moments FSDP2 keeps on the host under ``states``, against the plan's
``host_peak_memory_bytes``) and step time (the last step against the simulator's).  Then the
same model without the host tier (no state offload, no host budget) at the same length where
it fits, else at the longest it trains: tokens/s beside each other.

The longest length at a whole H100's memory is long (Llama-3.2-1B: about 1M tokens with the
host tier, 400K without; minutes a step): ``--memory-budget-gib`` caps the device budget (the
suite's 10 GiB gives about 64K tokens, ten seconds a step) and ``--max-length`` the search.  The
model's ``max_position_embeddings`` caps it too (``--positions`` raises it).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

import benchmarks.gpu.gpu_common as gc_
from benchmarks.lib.paths import RESULTS
from infinipipe_hf import InfiniPipeConfig, PipelineEngine

GIB = 2**30
TINY = {"memory_budget_gib": 0.005, "host_memory_gib": 0.05, "max_length": 4096}
"""The dry run's budgets: small enough that the tiny model's longest length needs the host tier."""


def host_memory_gib(args) -> float:
    """``--host-memory-gib``, else the machine's memory less ``--host-margin`` of it."""
    from infinipipe_hf.config import host_memory_bytes

    if args.host_memory_gib is not None:
        return args.host_memory_gib
    return host_memory_bytes() / GIB * (1.0 - args.host_margin)


def build(config: dict, device, dtype, args, profile_path: str, *, offload: str, host_gib: float):
    """A fresh model, engine and optimizer (fused AdamW; in a ``HostOptimizer`` under ``optimizer``)."""
    from infinipipe_hf.runtime.offload.host_optimizer import offload_optimizer

    model = gc_.make_model(config, device, dtype)
    cfg = InfiniPipeConfig(pp_degree=1, profile=profile_path, attention_backend=args.attention_backend,
                           memory_budget_gib=args.memory_budget_gib, loss_chunk_tokens=args.loss_chunk_tokens,
                           state_offload=offload, host_memory_gib=host_gib)
    engine = PipelineEngine(model, cfg, device=device)
    params = list(engine.parameters())
    # Weights on the host (``states``): the step runs on their host shards, torch's CPU default.
    fused = device.type == "cuda" and offload != "states"
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused) if fused else torch.optim.AdamW(params, lr=1e-5)
    return engine, offload_optimizer(opt, engine.layout.dims, engine.host_tier)


def longest(engine, cap: int) -> int:
    """The longest single sequence the engine's planner trains (up to ``cap``), found as the
    layout search finds it and confirmed by ``plan_step`` (0: not even the shortest searched)."""
    from infinipipe_hf.planner.layout_search.longest import RESOLUTION, SMALLEST, candidates_fit, largest_length
    from infinipipe_hf.planner.search.api import plan_step

    req = engine.default_planner.request(engine)
    spec, dims, options = req["spec"], req["dims"], req["options"]
    cost = options.cost(spec, dims)
    n = largest_length(lambda k: candidates_fit([k], cost, options), seed=4096, cap=cap)
    step = max(1, n // RESOLUTION)
    while n >= SMALLEST and not plan_step([n], spec, dims, options, cost=cost).feasible:
        n -= step
    return n if n >= SMALLEST else 0


def states_host_bytes(engine, opt) -> int:
    """Bytes of parameters, gradients and optimizer states in host memory outside the host tier's
    accounting (FSDP2's CPU offload under ``states``; 0 when they live on the device), taken after
    the optimizer step, when all three exist."""
    from infinipipe_hf.runtime.parallel.fsdp_api import local_tensor

    if not engine.layout.dims.state_offload.weights_on_host:
        return 0
    tensors = [local_tensor(p) for p in engine.parameters()]
    tensors += [local_tensor(p.grad) for p in engine.parameters() if p.grad is not None]
    tensors += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def plan_facts(plan, sim) -> dict:
    levels = plan.checkpoint_levels.get(0, {})
    facts = {"num_units": len(plan.units), "num_slices": plan.info.get("num_slices"),
             "checkpoint_levels": {str(u): v for u, v in sorted(levels.items())},
             "offloaded_layers": sum(v.get("offload", 0) for v in levels.values()),
             "offload_kv": list(plan.offload_kv),
             "predicted_host_peak_gib": float(plan.info.get("host_peak_memory_bytes", 0.0)) / GIB}
    if sim is not None:
        facts.update(predicted_step_s=sim.step_time_s, predicted_device_peak_gib=sim.peak_memory_bytes[0] / GIB)
    return facts


def ratios(row: dict) -> None:
    """Predicted over measured, where both are known."""
    for name, pred, meas in (("step", "predicted_step_s", "measured_step_s"),
                             ("device_peak", "predicted_device_peak_gib", "peak_gib"),
                             ("host_peak", "predicted_host_peak_gib", "host_peak_gib")):
        if row.get(pred) and row.get(meas):
            row[f"{name}_predicted_over_measured"] = row[pred] / row[meas]


def fits(engine, n: int) -> bool:
    """Whether ``plan_step`` fits one sequence of ``n`` tokens on the engine's layout and budgets."""
    from infinipipe_hf.planner.search.api import plan_step

    return plan_step([n], **engine.default_planner.request(engine)).feasible


def measure(engine, opt, n: int, device, args, vocab: int) -> dict:
    """Plan one sequence of ``n`` tokens, run the steps, measured beside predicted."""
    batch = [{"input_ids": gc_.random_ids(n, vocab, seed=n)}]
    t0 = time.perf_counter()
    plan, sim = engine.make_plan([n])
    facts = {"planning_s": time.perf_counter() - t0, **plan_facts(plan, sim)}

    states = [0]

    def step():
        out = engine.train_step(batch, plan=plan)
        opt.step()
        states[0] = max(states[0], states_host_bytes(engine, opt))  # gradients and moments alive
        opt.zero_grad(set_to_none=True)
        return out

    engine.host_tier.reset_peak()
    try:
        row, out = gc_.timed_steps(step, device, n, warmup=args.warmup, steps=args.steps)
    except Exception as exc:  # an OOM row keeps what was planned, to compare with what was reached
        raise gc_.RowError(exc, {**facts, **gc_.memory_at_failure(device)}) from exc
    stats = engine.host_tier.stats
    host = stats.peak_bytes + states[0]
    row.update(facts, loss=out.loss, measured_step_s=row["step_times_s"][-1], host_peak_gib=host / GIB,
               host_tier={"peak_gib": stats.peak_bytes / GIB, "copied_out_gib": stats.bytes_out / GIB,
                          "copied_in_gib": stats.bytes_in / GIB, "copies_out": stats.copies_out,
                          "copies_in": stats.copies_in,
                          "resident_gib": {k: v / GIB for k, v in stats.resident.items()}},
               process_max_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    ratios(row)
    return row


def configuration(config: dict, device, dtype, args, profile_path: str, *, offload: str, host_gib: float,
                  cap: int, same_length: int | None = None) -> dict:
    """Build, find the length (the longest up to ``cap``; ``same_length`` when it fits), measure."""
    engine, opt = build(config, device, dtype, args, profile_path, offload=offload, host_gib=host_gib)
    t0 = time.perf_counter()
    if same_length is not None and fits(engine, same_length):
        n = same_length
    else:
        n = longest(engine, cap)
    facts = {"state_offload": offload, "host_memory_gib": host_gib, "length": n,
             "same_length": n == same_length if same_length else None, "search_s": time.perf_counter() - t0}
    if not n:
        return {**facts, "error": "no length fits (not even 256 tokens)"}
    try:
        return {**facts, **measure(engine, opt, n, device, args, config["vocab_size"])}
    except gc_.RowError as exc:
        raise gc_.RowError(exc.cause, {**facts, **exc.facts}) from exc.cause


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="HF config.json (default: shipped llama3.2-1b)")
    p.add_argument("--tiny", action="store_true", help="tiny random model (CPU dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--state-offload", default="optimizer", choices=["optimizer", "states"])
    p.add_argument("--host-memory-gib", type=float, default=None,
                   help="host memory the plan may use (default: the machine's less --host-margin)")
    p.add_argument("--host-margin", type=float, default=0.15,
                   help="share of the machine's memory left to the process and the system")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="the device budget (default: the device's memory less the engine's margin)")
    p.add_argument("--max-length", type=int, default=None, help="longest length searched")
    p.add_argument("--positions", type=int, default=None, help="raise the model's max_position_embeddings")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--profile", default=None, help="cost profile (default: the shipped H100 profile)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--loss-chunk-tokens", type=int, default=4096)
    p.add_argument("--out", default=str(RESULTS / "offload_reach_gpu.json"))
    args = p.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    if not 0.0 <= args.host_margin < 1.0:
        raise SystemExit(f"error: --host-margin must be in [0, 1), got {args.host_margin}")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"error: --steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


def main(argv=None) -> int:
    from infinipipe_hf.config import host_memory_bytes
    from infinipipe_hf.planner.search.limits import SEARCH_CAP

    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --tiny --device cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = gc_.load_config(args.config, args.tiny)
    if args.positions:
        config["max_position_embeddings"] = args.positions
    cap = min(SEARCH_CAP, int(config.get("max_position_embeddings") or SEARCH_CAP), args.max_length or SEARCH_CAP)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = gc_.bench_profile_path(args.profile, dtype, device)
    host_gib = host_memory_gib(args)
    res = {"model": "tiny" if args.tiny else Path(args.config or "llama3.2-1b").stem, "env": gc_.environment(device),
           "dtype": args.dtype, "args": vars(args), "machine_memory_gib": host_memory_bytes() / GIB,
           "host_memory_gib": host_gib, "length_cap": cap, "rows": []}
    kw = dict(config=config, device=device, dtype=dtype, args=args, profile_path=profile_path, cap=cap)
    row = gc_.guarded("host_tier", lambda: configuration(**kw, offload=args.state_offload, host_gib=host_gib),
                      device)
    res["rows"].append(row)
    out.write_text(json.dumps(res, indent=1))  # the offload row survives a failing baseline
    n = row.get("length") or None
    base = gc_.guarded("no_host_tier", lambda: configuration(**kw, offload="none", host_gib=0.0, same_length=n),
                       device)
    res["rows"].append(base)
    res["longest_with_host_tier"], res["longest_without_host_tier"] = row.get("length"), base.get("length")
    if row.get("tokens_per_s") and base.get("tokens_per_s"):
        res["tokens_per_s_host_tier_over_without"] = row["tokens_per_s"] / base["tokens_per_s"]
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
