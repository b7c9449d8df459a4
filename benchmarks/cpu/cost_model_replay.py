"""The cost model alone against the runtime's compute, without processes, messages or other ranks.

    python -m benchmarks.cpu.cost_model_replay [--layouts 2,4] [--schedules epp,seq1f1b,...] [--repeats 4]

For each pipeline degree and schedule, plans the ``sim_vs_real`` batch at the budget recorded in
``benchmarks/results/sim_vs_real.json`` with the profile beside it, then in ONE process and one
thread runs every stage's action list in the plan's order through the runtime's ``StageRunner``
(random hidden states and gradients stand in for the neighbours' messages), timing each action's
thread CPU seconds, median over repeats (the first is a warm-up).  The speed probe of
``sim_vs_real`` (``SPEED_PROBE_SHAPES``) runs before and after, and the profile is rescaled to its
factor as there.  Output: measured / predicted per (stage, F/B) and the extreme actions, to
``benchmarks/results/cost_model_replay.json``.

Why: ``sim_vs_real`` compares whole distributed steps, where an error can come from the cost
model (per-action seconds), the machine model (ranks sharing cores, messages) or the machine's
speed moving between the probe and the steps.  Here only the first is left: if these ratios are
near 1 while a distributed run's per-action CPU seconds are not, the gap is not the cost model's.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.cpu.cpu_profile import LOSS_CHUNK_TOKENS, MODEL, SPEED_PROBE_SHAPES, machine, spec_of
from benchmarks.cpu.sim_compare import _actions_work
from benchmarks.cpu.sim_vs_real import LENGTHS, cost_for, layers_per_stage
from benchmarks.lib.paths import RESULTS
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.search.api import PlanOptions


def probe_rows(model) -> list[dict]:
    from benchmarks.lib.runtime_rows import UnitCase, measure_unit_rows

    cases = [UnitCase(tuple(tuple(s) for s in segs), level) for segs, level in SPEED_PROBE_SHAPES]
    return measure_unit_rows(copy.deepcopy(model), cases, repeat=5)


def replay_stages(model, plan, pp: int, repeats: int) -> dict[tuple[int, str], float]:
    """Median thread CPU seconds of every (stage, action), the stages run one after another."""
    import torch

    from infinipipe_hf.runtime.stage.module import build_stage
    from infinipipe_hf.runtime.stage.runner import StageRunner

    counts = layers_per_stage(pp)
    starts = [sum(counts[:i]) for i in range(pp)]
    runners = [StageRunner(build_stage(copy.deepcopy(model), s, range(starts[s], starts[s] + counts[s])),
                           loss_chunk_tokens=LOSS_CHUNK_TOKENS) for s in range(pp)]
    g = torch.Generator().manual_seed(1)
    batch = [{"input_ids": torch.randint(0, MODEL["vocab_size"], (n,), generator=g).tolist()} for n in LENGTHS]
    hidden = MODEL["hidden_size"]
    cpu = defaultdict(list)
    for rep in range(repeats + 1):
        for s, runner in enumerate(runners):
            runner.begin_step(plan, batch, sum(n - 1 for n in LENGTHS))
            for a in plan.stage_actions(0, s):
                n = plan.unit_by_id[a.unit].num_tokens
                if a.is_forward:
                    x = None if s == 0 else torch.randn(1, n, hidden, generator=g)
                    c0 = time.thread_time()
                    runner.forward(a.unit, x)
                else:
                    x = None if s == pp - 1 else torch.randn(1, n, hidden, generator=g)
                    c0 = time.thread_time()
                    runner.backward(a.unit, x)
                if rep:  # the first pass warms the allocator and caches up
                    cpu[(s, str(a))].append(time.thread_time() - c0)
            runner.end_step()
            for p in runner.stage.parameters():
                p.grad = None
    return {k: statistics.median(v) for k, v in cpu.items()}


def run_case(pp: int, schedule: str, repeats: int, profile, budget: float, log=print, shared=None) -> dict:
    import torch
    import transformers

    from benchmarks.lib.runtime_fit import rescale_compute, speed_factor
    from infinipipe_hf.planner.search.api import plan_step

    spec = spec_of(MODEL)
    plan = plan_step(LENGTHS, spec, ParallelDims(pp_degree=pp), PlanOptions(schedule=schedule), cost=cost_for(profile, pp, 1, budget, shared)).plan
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).float()
    rows = probe_rows(model)
    measured = replay_stages(model, plan, pp, repeats)
    rows += probe_rows(model)
    factor = speed_factor(profile, spec, rows)
    duration, _ = _actions_work(plan, cost_for(rescale_compute(profile, factor), pp, 1, budget, shared))
    sums = defaultdict(lambda: [0.0, 0.0])
    actions = []
    for s in range(pp):
        for a in plan.stage_actions(0, s):
            m, p = measured[(s, str(a))], duration(s, a)
            sums[(s, a.kind)][0] += m
            sums[(s, a.kind)][1] += p
            actions.append({"stage": s, "action": str(a), "measured_cpu_s": m, "predicted_s": p, "ratio": m / p})
    actions.sort(key=lambda r: r["ratio"])
    per_kind = [{"stage": s, "kind": k, "measured_cpu_s": m, "predicted_s": p, "ratio": m / p}
                for (s, k), (m, p) in sorted(sums.items())]
    total = sum(m for m, _ in sums.values()) / sum(p for _, p in sums.values())
    log(f"  pp {pp} {schedule}: speed x{factor:.3f}, measured / predicted {total:.3f} over the step, "
        f"per (stage, F/B) {min(r['ratio'] for r in per_kind):.3f}-{max(r['ratio'] for r in per_kind):.3f}")
    return {"pp_degree": pp, "schedule": schedule, "num_units": len(plan.units), "speed_factor": factor,
            "step_ratio": total, "per_stage_kind": per_kind, "lowest_actions": actions[:3],
            "highest_actions": actions[-3:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="2,4", help="pipeline degrees (no SP: one process runs every stage)")
    ap.add_argument("--schedules", default="epp,packed-1f1b,seq1f1b,gpipe")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--source", default=str(RESULTS / "sim_vs_real.json"),
                    help="sim_vs_real output whose profile and budgets to use")
    ap.add_argument("--out", default=str(RESULTS / "cost_model_replay.json"))
    args = ap.parse_args(argv)
    import torch

    from benchmarks.lib.shared_cores import load_profile

    torch.set_num_threads(1)
    source = json.loads(Path(args.source).read_text())
    # Planned as sim_vs_real planned them: on the cores its ranks shared.
    profile, shared = load_profile(Path(args.source).with_name(source["profile"]["path"]))
    t0 = time.time()
    cases = []
    for pp in map(int, args.layouts.split(",")):
        for schedule in args.schedules.split(","):
            budget = source["budgets"][f"pp{pp}"][schedule][0]
            cases.append(run_case(pp, schedule, args.repeats, profile, budget, shared=shared))
    ratios = [r["ratio"] for c in cases for r in c["per_stage_kind"]]
    result = {"what": "measured / predicted CPU seconds of every action, stages replayed in one process",
              "machine": machine(), "source": Path(args.source).name, "repeats": args.repeats, "cases": cases,
              "per_stage_kind_ratio_range": [min(ratios), max(ratios)],
              "step_ratio_range": [min(c["step_ratio"] for c in cases), max(c["step_ratio"] for c in cases)],
              "elapsed_s": time.time() - t0, "command": "python -m benchmarks.cpu.cost_model_replay"}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"per (stage, F/B) measured / predicted {result['per_stage_kind_ratio_range'][0]:.3f}-"
          f"{result['per_stage_kind_ratio_range'][1]:.3f}, per step {result['step_ratio_range'][0]:.3f}-"
          f"{result['step_ratio_range'][1]:.3f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
