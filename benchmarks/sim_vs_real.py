"""Simulator vs a real pp=2 gloo run on CPU: same plan, same order of actions, step time compared.

    python benchmarks/sim_vs_real.py [--out benchmarks/results/sim_vs_real.json] [--quick]

1. Fit the cost model to this machine: one decoder layer of the benchmark model is timed through
   the runtime's own code path (``StageRunner.forward`` with graph and ``epp`` attention, then
   ``backward``; float32, one thread) at a few lengths, the LM head + loss with the profiler's
   ``measure_head``, and the rows are fitted by ``planner.hardware.fit_profile`` (the fitter of
   ``python -m infinipipe_hf.profile``).  The profiler's own layer rows time the forward under
   ``no_grad`` with HF's SDPA; in a first run with those rows the runtime's forwards took 1.58x
   and its backwards 1.26x the simulated time (graph recording, per-segment attention calls).
   Point-to-point cost over gloo/loopback is not measured: latency 0.2 ms and 1 GB/s are assumed
   (a 512-token unit of hidden 256 in float32 is 0.5 MB, so transfers are ~1% of an action).
2. Run one step with ``PipelineEngine`` (schedule ``epp``, the engine's own planner with that
   profile) on 2 gloo processes (``torch.set_num_threads(1)`` each), one warm-up + timed steps.
3. Re-simulate the executed plan with the same profile and compare (a) per stage, the simulated
   order of actions with the executed one (the engine's merged timeline), (b) simulated step time
   with the measured timeline span, and per action kind the mean measured / simulated duration.

Trade-off: the layer is timed on one whole sequence, so packed units (one SDPA call per segment)
and slices with context (explicit masks) are extrapolated by the fit; CPU timings on a machine
shared with other jobs are noisy (the profile and the run see different load); the figure says
how far the model is on this machine, not on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
             tie_word_embeddings=False)
LENGTHS = [1536, 700, 420, 300, 260, 180, 120, 90]
MAX_TOKENS_PER_UNIT = 512


def runtime_layer_rows(lengths, *, warmup: int, repeat: int) -> list[dict]:
    """``layer_causal`` rows timed through the runtime's own path: ``StageRunner.forward`` (graph
    recorded, ``epp`` attention) and ``backward`` of a one-layer middle stage on one sequence."""
    import torch
    import transformers

    from infinipipe_hf.planner.actions import Action
    from infinipipe_hf.planner.plan import Plan
    from infinipipe_hf.planner.units import Segment, Unit
    from infinipipe_hf.runtime.stage import build_stage
    from infinipipe_hf.runtime.stage_runner import StageRunner

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**MODEL, "num_hidden_layers": 3})
    runner = StageRunner(build_stage(transformers.LlamaForCausalLM(cfg).float(), 1, range(1, 2)))
    rows = []
    for n in lengths:
        plan = Plan("epp", 3, 1, [n], [Unit(0, (Segment(0, 0, n),))],
                    {0: [[], [Action("F", 0), Action("B", 0)], []]}, {}, [1, 1, 1])
        x, g = torch.randn(1, n, MODEL["hidden_size"]), torch.randn(1, n, MODEL["hidden_size"])
        fwd, bwd = [], []
        for i in range(warmup + repeat):
            runner.begin_step(plan, [{"input_ids": [0] * n}], n - 1)
            t0 = time.perf_counter()
            runner.forward(0, x)
            t1 = time.perf_counter()
            runner.backward(0, g)
            t2 = time.perf_counter()
            runner.end_step()
            for prm in runner.stage.parameters():
                prm.grad = None
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        f, b = statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3
        rows.append({"kind": "layer_causal", "tokens": n, "fwd_ms": f, "fwd_bwd_ms": f + b,
                     "saved_bytes_per_token": 0.0})
    return rows


def fit_cpu_profile(quick: bool, log=print):
    """A float32, one-thread CPU profile of the benchmark model on this machine (see module doc)."""
    import torch

    from infinipipe_hf.planner.hardware import fit_profile
    from infinipipe_hf.profiling.measure import measure_head
    from infinipipe_hf.profiling.modules import build_modules, reference_shape

    torch.set_num_threads(1)
    lengths = (128, 256, 512) if quick else (128, 256, 512, 768, 1024)
    repeat = 3 if quick else 5
    rows = runtime_layer_rows(lengths, warmup=1, repeat=repeat)
    m = build_modules({"model_type": "llama", **MODEL}, torch.device("cpu"), torch.float32)
    rows += [measure_head(m, n, torch.device("cpu"), torch.float32, warmup=1, repeat=repeat)
             for n in (256, 512, 1024)]
    for r in rows:
        log(f"  {r['kind']:>12} {r['tokens']:>5} tokens: fwd {r['fwd_ms']:.1f} ms, fwd+bwd {r['fwd_bwd_ms']:.1f} ms")
    profile = fit_profile(rows, reference_shape(m.spec), name="cpu-fp32-1thread", memory_gib=64.0,
                          device="cpu", meta={"rows": rows})
    # Saved bytes come from the cost model's formula (checked in test_memory_model_vs_runtime.py).
    from infinipipe_hf.planner.cost_model import _act_elements

    profile = dataclasses.replace(profile, bytes_per_element=4, p2p_latency_s=2e-4,
                                  p2p_bandwidth_bytes_per_s=1e9,
                                  activation_bytes_per_token_per_layer=_act_elements(m.spec) * 4.0)
    return profile, rows


def launch(spec: dict, nproc: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=str(Path(tmp) / "out.json"))
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        torchrun = Path(sys.executable).parent / "torchrun"
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        p = subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={nproc}",
                            str(HERE / "runtime_worker.py"), str(spec_path)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"runtime_worker failed (exit {p.returncode}):\n{p.stdout[-4000:]}")
        print(p.stdout.strip())
        return json.loads(Path(spec["out"]).read_text())


def compare(run: dict, profile, pp: int) -> dict:
    from infinipipe_hf.planner.cost_model import CostModel
    from infinipipe_hf.planner.model_spec import ModelSpec
    from infinipipe_hf.planner.plan import Plan
    from infinipipe_hf.planner.simulator import simulate
    from infinipipe_hf.runtime.timeline import Timeline

    plan = Plan.from_dict(run["plan"])
    spec = ModelSpec.from_config_dict({"model_type": "llama", **MODEL})
    cost = CostModel(spec, profile, pp_degree=pp, layers_per_stage=plan.layers_per_stage)
    sim = simulate(plan, cost)
    tl = Timeline.from_dict(run["timeline"])
    orders_equal, per_stage = True, {}
    ratios: dict[str, list[float]] = {"F": [], "B": []}
    sim_by = {(e.stage, e.action): e for e in sim.events}
    for s in range(pp):
        simulated = [e.action for e in sorted((e for e in sim.events if e.stage == s), key=lambda e: e.start_s)]
        executed = [e.action for e in sorted((e for e in tl.events if e.stage == s), key=lambda e: e.start_s)]
        per_stage[s] = {"simulated": simulated, "executed": executed, "equal": simulated == executed}
        orders_equal &= simulated == executed
        for e in tl.events:
            if e.stage == s:
                se = sim_by[(s, e.action)]
                ratios[e.action[0]].append((e.duration_s - e.wait_s) / max(se.end_s - se.start_s, 1e-12))
    measured = tl.span_s
    return {
        "orders_equal": orders_equal, "orders": per_stage,
        "simulated_step_s": sim.step_time_s, "measured_step_s": measured,
        "measured_step_wall_s": run["step_wall_s"],
        "relative_difference": (sim.step_time_s - measured) / measured,
        "simulated_bubble_fraction": sim.bubble_fraction, "measured_bubble_fraction": tl.bubble_fraction(),
        "measured_over_simulated_action_time": {k: statistics.mean(v) for k, v in ratios.items() if v},
        "num_units": len(plan.units), "num_pipelines": plan.num_pipelines,
        "checkpoint_layers": {str(k): v for k, v in plan.checkpoint_layers.items()},
        "loss": run["losses"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "sim_vs_real.json"))
    ap.add_argument("--quick", action="store_true", help="fewer profile points and steps (tests)")
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    t0 = time.time()
    profile, _ = fit_cpu_profile(args.quick, log=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = out.with_name(out.stem + ".profile.json")
    profile.save(profile_path)
    pp = 2
    spec = {"model": MODEL, "lengths": LENGTHS, "schedules": ["epp"], "pp_degree": pp,
            "profile": str(profile_path), "max_tokens_per_unit": MAX_TOKENS_PER_UNIT,
            "warmup": 1, "steps": 1 if args.quick else 3, "seed": 0}
    run = launch(spec, pp, args.timeout)["epp"]
    result = compare(run, profile, pp)
    result.update({
        "machine": f"CPU, {__import__('os').cpu_count()} cores (shared), gloo, 1 thread per rank",
        "model": MODEL, "lengths": LENGTHS, "max_tokens_per_unit": MAX_TOKENS_PER_UNIT,
        "profile": {"path": profile_path.name, "layer_forward": dataclasses.asdict(profile.layer_forward),
                    "layer_backward": dataclasses.asdict(profile.layer_backward),
                    "head_forward": dataclasses.asdict(profile.head_forward),
                    "head_backward": dataclasses.asdict(profile.head_backward),
                    "p2p": "assumed: 0.2 ms latency, 1 GB/s"},
        "goal": "|simulated - measured| / measured < 0.20", "elapsed_s": time.time() - t0,
    })
    out.write_text(json.dumps(result, indent=1))
    print(f"orders equal: {result['orders_equal']}; simulated {result['simulated_step_s']:.3f} s vs "
          f"measured {result['measured_step_s']:.3f} s ({result['relative_difference']:+.1%}); "
          f"measured/simulated action time {result['measured_over_simulated_action_time']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
