"""EPP and the baselines through the real runtime on CPU: tokens/s side by side, and equal losses.

    python -m benchmarks.cpu.runtime_cpu_bench [--pp 2] [--out benchmarks/results/runtime_cpu_bench.json]

The batch is real and long-tailed: the token counts of Python's standard library sources
(``infinipipe_hf.data.corpus.document_lengths("stdlib")``, SmolLM2 tokenizer), scaled so the
longest document is 3072 tokens and sampled at 48 evenly spaced quantiles (longest included), so a
small float32 model trains it on CPU in seconds while keeping the corpus' shape (the longest
document carries about half the tokens).  Every schedule (``epp``, ``packed-1f1b``, ``seq1f1b``,
``gpipe``) runs the same batch on the same weights through ``PipelineEngine`` on gloo
(``benchmarks/workers/runtime_worker.py``, one thread per rank), planned by the engine's own planner with
a CPU profile fitted on this machine (``cpu_profile.fit_cpu_profile``; the ranks share its cores,
``benchmarks/lib/shared_cores.py``) and a memory budget small
enough that one unsliced, uncheckpointed unit of the longest document does not fit, so the
planners must slice, pack and checkpoint as they would on a GPU at scale.

The losses must be identical across schedules up to float32 summation order: slicing, packing and
checkpointing are exact.  CPU numbers say little about GPUs (kernels, launch overheads and memory
behave differently); this checks the machinery end to end, one process per stage.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.cpu.cpu_profile import MODEL, fit_cpu_profile, machine_sharing
from benchmarks.cpu.sim_vs_real import launch
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.shared_cores import save_profile
from infinipipe_hf.layout import ParallelDims

SCHEDULES = ["epp", "packed-1f1b", "seq1f1b", "gpipe"]


def stdlib_batch(longest: int = 3072, count: int = 48) -> list[int]:
    from infinipipe_hf.data.corpus import document_lengths

    lengths = sorted(document_lengths("stdlib"))
    scaled = [max(8, round(n * longest / lengths[-1])) for n in lengths]
    idx = [round(i * (len(scaled) - 1) / (count - 1)) for i in range(count)]
    return [scaled[i] for i in idx][::-1]


def memory_budget_gib(profile, lengths: list[int], pp: int) -> float:
    """Model states of the fullest stage + activations of half the longest document, uncheckpointed."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.planner.cost.model import CostModel

    spec = ModelSpec.from_config_dict({"model_type": "llama", **MODEL})
    cost = CostModel(spec, profile, ParallelDims(pp_degree=pp))
    half = max(lengths) // 2
    need = max(cost.acts.static_bytes(s) + cost.acts.activation_bytes(s, half, 0) + cost.acts.kv_bytes(s, half)
               + cost.acts.working_bytes(s, half, 1, backward=True) for s in range(pp))
    return need / 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "runtime_cpu_bench.json"))
    ap.add_argument("--timeout", type=float, default=580)
    args = ap.parse_args(argv)
    t0 = time.time()
    lengths = stdlib_batch()
    profile, _ = fit_cpu_profile(quick=True, log=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = out.with_name(out.stem + ".profile.json")
    save_profile(profile_path, profile, machine_sharing())  # the ranks share this machine's cores
    budget = memory_budget_gib(profile, lengths, args.pp)
    spec = {"model": MODEL, "lengths": lengths, "schedules": SCHEDULES, "pp_degree": args.pp,
            "profile": str(profile_path), "memory_budget_gib": budget, "warmup": 1,
            "steps": args.steps, "seed": 0}
    runs = launch(spec, args.pp, args.timeout)
    rows, losses = [], {}
    for name in SCHEDULES:
        r = runs.get(name, {"error": "not run"})
        if "error" in r:
            rows.append({"schedule": name, "error": r["error"]})
            continue
        step = statistics.median(r["step_wall_s"])
        losses[name] = r["losses"][-1]
        rows.append({"schedule": name, "tokens_per_s": sum(lengths) / step, "step_s": step,
                     "step_wall_s": r["step_wall_s"], "simulated_step_s": r["simulated_step_s"],
                     "num_units": r["num_units"], "num_pipelines": r["num_pipelines"],
                     "loss": r["losses"][-1], "plan_info": r["plan_info"],
                     "checkpointed_layers": sum(sum(v.values()) for v in r["plan"]["checkpoint_layers"].values()),
                     "measured_bubble_fraction": _bubble(r["timeline"])})
    ref = losses.get("epp")
    spread = (max(losses.values()) - min(losses.values())) if losses else None
    result = {
        "machine": f"CPU, {__import__('os').cpu_count()} cores shared with other jobs, gloo, pp={args.pp}, "
                   f"1 thread per rank, float32",
        "note": "CPU numbers say little about GPUs; they check the runtime end to end.",
        "model": MODEL, "lengths": lengths, "num_tokens": sum(lengths),
        "memory_budget_gib": budget, "rows": rows,
        "losses": losses, "loss_max_minus_min": spread,
        "loss_max_relative_difference": (spread / abs(ref)) if ref else None,
        "elapsed_s": time.time() - t0,
    }
    out.write_text(json.dumps(result, indent=1))
    for row in rows:
        if "error" in row:
            print(f"{row['schedule']:>12}: infeasible: {row['error'][:120]}")
        else:
            print(f"{row['schedule']:>12}: {row['tokens_per_s']:8.0f} tokens/s  step {row['step_s']:.3f} s  "
                  f"(simulated {row['simulated_step_s']:.3f} s)  {row['num_units']} units  "
                  f"loss {row['loss']:.10f}")
    print(f"loss spread across schedules: {spread}; wrote {out}")
    return 0


def _bubble(timeline: dict) -> float:
    from infinipipe_hf.runtime.engine.timeline import Timeline

    return Timeline.from_dict(timeline).bubble_fraction()


if __name__ == "__main__":
    sys.exit(main())
