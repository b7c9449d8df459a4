"""The layout search's verdict against the alternatives, on held-out batches, through the planner CLI.

Llama-2-13B on 8 GPUs of 80 GiB (one node), four batch kinds the planner tables never planned
(seed 1; the tables use seed 0): short-only, SlimPajama-like, ProLong-like and the real
stdlib + Shakespeare + KJV mix, 512 sequences each.  Each batch runs exactly
``python -m infinipipe_hf.plan --model llama2-13b.json --lengths L --world-size 8 --gpus-per-node 8
--gpu-memory-gib 80 --search-layout --json`` with the shipped (default) profile, and records
``recommended.over_alternatives``, its minimum per batch, the geometric mean of those minima, the
search's wall time, and which profile and efficiencies priced it.

The search prices sharded-over-SP layouts with their gradients reduced once per step and after
every unit (``--grad-reduce auto``) and keeps the faster; each row records which the pick uses.
Beside it, per batch, EPP at pp 1 x sp 8 sharded over SP planned both ways (``grad_reduce="step"``
and ``"unit"``): the layout that holds FlexSP's and ZeRO-3 + Ulysses' plans, where keeping every
unsharded fp32 gradient through the step is what set EPP apart from them.

    python -m benchmarks.planner.verdict     # writes benchmarks/results/planner_verdict.json

With ``--host-memory-gib G`` every search also gets ``--host-memory-gib G`` (a host tier of G GiB per
GPU: EPP may offload activations and model states, and ALST joins the alternatives); ``--profile``
prices with another profile, and ``--host-link-gbps`` / ``--host-adamw-gparams`` with the default's
host link and CPU AdamW speed replaced (never measured on an H100 here: the defaults are 40 GB/s
and 1 G parameters/s per GPU).  Such runs go to ``planner_verdict_host.json`` (one entry of its
``runs`` per setting) unless ``--out`` says otherwise, without the pp 1 x sp 8 what-if.

    python -m benchmarks.planner.verdict --host-memory-gib 256   # a DGX H100's 2 TiB over 8 GPUs
    python -m benchmarks.planner.verdict --host-memory-gib 256 --host-link-gbps 25 --host-adamw-gparams 0.5

``--activation-scale S`` prices every system's decoder layer as keeping ``S`` times the profile's
measured activation bytes per token (a what-if for leaner layers, e.g. 0.8246: the share of a 13B
layer's bytes beyond what HF's two RMSNorms need, their input; EPP and every alternative alike).

    python -m benchmarks.planner.verdict --activation-scale 0.8246 --out benchmarks/results/planner_verdict_activation_scale.json

``--gpu-memory-gib G`` runs the same searches on GPUs of G GiB (the budget the CLI derives from it):
where FlexSP's few rounds of single-GPU units sit near the budget, the pick must still not trail
it.  Such runs go to ``planner_verdict_memory.json``, one entry of its ``runs`` per size.

    python -m benchmarks.planner.verdict --gpu-memory-gib 48
    python -m benchmarks.planner.verdict --gpu-memory-gib 40

``--flexsp-milp`` also plans FlexSP per batch with its bucketed MILP group solver (1 s per round
problem) beside the greedy one the search uses, so a row shows whether the verdict's FlexSP is
the best FlexSP the repository can plan (minutes per batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.paths import REPO, RESULTS
from benchmarks.planner.planner_tables.setups import real_batch
from infinipipe_hf.cli.inputs import read_profile
from infinipipe_hf.data import synthetic
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.layout_search.bound import step_time_bound
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step

OUT = RESULTS / "planner_verdict.json"
HOST_OUT = RESULTS / "planner_verdict_host.json"
MEMORY_OUT = RESULTS / "planner_verdict_memory.json"
MODEL = REPO / "infinipipe_hf" / "models" / "configs" / "llama2-13b.json"
SEED = 1
"""Held out: the planner tables' batches use seed 0."""


def held_out_batches(n: int = 512) -> dict[str, list[int]]:
    return {"short-only": synthetic.short_only(n=n, max_len=2048, seed=SEED),
            "slimpajama-like": synthetic.slimpajama_like(n=n, max_len=131072, seed=SEED),
            "prolong-like": synthetic.prolong_like(n=n, max_len=131072, seed=SEED),
            "real mix": real_batch(("stdlib", "shakespeare", "kjv"), n, seed=SEED)}


def search(lengths: list[int], tmp: Path, name: str, extra: list[str]) -> tuple[dict, float, list[str]]:
    """The CLI's layout search on ``lengths`` (``extra``: more CLI arguments): its JSON, its wall
    time, the command."""
    path = tmp / f"{name.replace(' ', '_')}.txt"
    path.write_text("\n".join(map(str, lengths)))
    cmd = [sys.executable, "-m", "infinipipe_hf.plan", "--model", str(MODEL), "--lengths", str(path),
           "--world-size", "8", "--gpus-per-node", "8", *extra, "--search-layout", "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 and "no layout of" not in done.stderr:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout) if done.returncode == 0 else {"no_layout_fits": done.stderr.strip().splitlines()[-1]}
    return got, time.perf_counter() - t0, cmd


def per_unit_reduce_what_if(lengths: list[int], budget_bytes: float) -> dict:
    """EPP at pp 1 x sp 8, shard sp, gradients reduced per step and per unit (``grad_reduce``)."""
    spec = ModelSpec.from_json_file(MODEL)
    out = {}
    for mode in ("step", "unit"):
        cost = CostModel(spec, default_profile(), ParallelDims(1, 8, 1, "sp", 8), memory_budget_bytes=budget_bytes,
                         grad_reduce=mode)
        s = plan_step(lengths, spec, options=PlanOptions(grad_reduce=mode), cost=cost).summary()
        out[mode] = {"tokens_per_s": s["tokens_per_s"], "feasible": s["feasible"],
                     "recompute_fraction": s.get("recompute_fraction"),
                     "static_state_gib": cost.states.peak_static_bytes(0) / GIB,
                     "peak_gib": max(s["peak_memory_bytes"]) / GIB if s.get("peak_memory_bytes") else None}
    return out


def step_anatomy(got: dict, lengths: list[int], host_gib: float, profile: str | None) -> dict:
    """Where the pick's step and the closest alternative's go, against the proven compute bound of
    the pick's layout (``layout_search/bound.py``: no recompute, bubbles, collectives or per-unit
    fixed terms): the rounds each plan runs and the recompute it pays (the alternative's summed over
    its groups, as its plans report it)."""
    rec = got["recommended"]
    dims = ParallelDims(rec["pp_degree"], rec["sp_degree"], rec["dp_degree"], rec["shard"], 8,
                        state_offload=rec.get("state_offload") or "none")
    cost = CostModel(ModelSpec.from_json_file(MODEL), read_profile(profile) if profile else default_profile(), dims,
                     memory_budget_bytes=got["memory_budget_bytes"], host_budget_bytes=host_gib * GIB,
                     grad_reduce=rec["plan"].get("grad_reduce") or "step")
    bound = step_time_bound(lengths, cost, rec.get("sp_rounds"))
    over = rec["over_alternatives"]
    alt = next(a for a in got["alternatives"] if a["schedule"] == min(over, key=over.get))
    rounds = rec["plan"].get("info", {}).get("sp_rounds") or {}
    c = cost.for_group(1).compute if dims.sp_degree > 1 else cost.compute
    return {"compute_bound_s": bound,
            "per_unit_fixed_s_one_gpu": sum(cost.layers_per_stage) * (c.layer_fwd.fixed_s + c.layer_bwd.fixed_s),
            "pick": {"step_time_s": rec["step_time_s"], "over_bound": rec["step_time_s"] / bound,
                     "recompute_time_s": rec["plan"]["recompute_time_s"], "units": rec["num_units"],
                     "rounds": rounds.get("rounds"), "units_per_group_size": rounds.get("units_per_group_size")},
            "closest_alternative": {"schedule": alt["schedule"], "step_time_s": alt["step_time_s"],
                                    "over_bound": alt["step_time_s"] / bound,
                                    "recompute_time_s_summed_over_groups": alt["recompute_time_s"],
                                    "rounds": alt["info"].get("num_rounds", alt["info"].get("rounds"))}}


def flexsp_solvers(lengths: list[int], budget_bytes: float) -> dict:
    """FlexSP's step time and planning time with its greedy and its MILP group solver."""
    spec = ModelSpec.from_json_file(MODEL)
    out = {}
    for solver in ("greedy", "milp"):
        r = plan_alternative(lengths, spec, "flexsp", world_size=8, gpus_per_node=8, memory_budget_bytes=budget_bytes,
                             solver=solver, milp_time_limit_s=1.0)
        out[solver] = {"step_time_s": r.simulation.step_time_s if r.feasible else None,
                       "planning_time_s": r.planning_time_s}
    return out


def row(name: str, lengths: list[int], tmp: Path, extra: list[str], flexsp_milp: bool = False,
        host_gib: float = 0.0, profile: str | None = None, with_what_if: bool = True) -> dict:
    got, wall, cmd = search(lengths, tmp, name, extra)
    if "no_layout_fits" in got:  # no EPP layout fits (the CLI's error says why)
        print(f"{name:16s} no layout fits; search {wall:.1f} s", flush=True)
        return {"batch": name, "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
                "no_layout_fits": got["no_layout_fits"], "search_wall_s": wall,
                "command": " ".join(cmd[1:]).replace(str(tmp), "TMP")}
    rec = got["recommended"]
    over = rec["over_alternatives"]
    best_alt = max(got["alternatives"], key=lambda a: a.get("tokens_per_s") or 0.0)
    what_if = per_unit_reduce_what_if(lengths, got["memory_budget_bytes"]) if with_what_if else None
    r = {"batch": name, "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
         "recommended": {**{k: rec[k] for k in ("label", "shard", "tokens_per_s", "peak_memory_bytes")},
                         "grad_reduce": rec["plan"].get("grad_reduce"), "state_offload": rec.get("state_offload"),
                         "recompute_fraction": rec["plan"].get("recompute_fraction"),
                         "host_peak_memory_bytes": rec.get("host_peak_memory_bytes")},
         "over_alternatives": over, "min_over_alternatives": min(over.values()),
         "min_alternative": min(over, key=over.get), "best_alternative": best_alt["schedule"],
         "pricing": got.get("pricing"), "search_wall_s": wall, "search_time_s": got["search_time_s"],
         "pp1_sp8_shard_sp": what_if, "step_anatomy": step_anatomy(got, lengths, host_gib, profile),
         **({"flexsp_solvers": flexsp_solvers(lengths, got["memory_budget_bytes"])} if flexsp_milp else {}),
         "command": " ".join(cmd[1:]).replace(str(tmp), "TMP")}
    print(f"{name:16s} recommended {rec['label']} shard {rec['shard']} grad_reduce {r['recommended']['grad_reduce']}: "
          f"{rec['tokens_per_s']:,.0f} tokens/s; " + ", ".join(f"{k} {v:.2f}x" for k, v in over.items())
          + f"; search {wall:.1f} s" + ("" if what_if is None else f"; pp1 x sp8 per-unit reduce "
          f"{what_if['unit']['tokens_per_s']:,.0f} (per-step {what_if['step']['tokens_per_s']:,.0f})"), flush=True)
    return r


def pricing_profile(args, tmp: Path) -> tuple[str | None, str]:
    """The profile file the searches get (None: the CLI's default) and its description."""
    if args.host_link_gbps is None and args.host_adamw_gparams is None and args.activation_scale is None:
        return args.profile, args.profile or "shipped default"
    base = HardwareProfile.load(args.profile) if args.profile else default_profile()
    changed = {}
    if args.host_link_gbps is not None:
        changed["host_bandwidth_bytes_per_s"] = args.host_link_gbps * 1e9
    if args.host_adamw_gparams is not None:
        changed["host_optimizer_params_per_s"] = args.host_adamw_gparams * 1e9
    if args.activation_scale is not None:
        changed["activation_bytes_per_token_per_layer"] = base.activation_bytes_per_token_per_layer * args.activation_scale
    path = tmp / "profile.json"
    dataclasses.replace(base, **changed).save(path)
    return str(path), (f"{args.profile or 'shipped default'} with " + ", ".join(f"{k}={v:g}" for k, v in changed.items()))


def save(out: Path, result: dict, keyed: bool) -> None:
    """Write ``result``; ``keyed`` (another GPU size, a host tier or another profile): as one of the
    file's ``runs``, replacing the run of the same settings, so the settings sit side by side."""
    if keyed:
        runs = json.loads(out.read_text()).get("runs", []) if out.exists() else []
        names = ("gpu_memory_gib", "host_memory_gib", "profile")
        key = tuple(result[k] for k in names)
        result = {"runs": [r for r in runs if tuple(r.get(k, 80) for k in names) != key] + [result]}
    out.write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help=f"default {OUT.name}, or {HOST_OUT.name} with a host tier or a profile")
    ap.add_argument("--n", type=int, default=512, help="sequences per batch")
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU memory (default 80: an H100)")
    ap.add_argument("--host-memory-gib", type=float, default=0.0, help="host memory per GPU (default 0: no host tier)")
    ap.add_argument("--profile", default=None, help="a profile JSON to price with (default: the shipped default)")
    ap.add_argument("--host-link-gbps", type=float, default=None, help="host link GB/s per direction per GPU")
    ap.add_argument("--host-adamw-gparams", type=float, default=None, help="CPU AdamW, 1e9 parameters/s per GPU")
    ap.add_argument("--activation-scale", type=float, default=None,
                    help="what-if: every layer keeps this times the profile's activation bytes per token")
    ap.add_argument("--flexsp-milp", action="store_true", help="also plan FlexSP with its MILP group solver (slow)")
    args = ap.parse_args()
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        profile, described = pricing_profile(args, Path(tmp))
        extra = ["--gpu-memory-gib", f"{args.gpu_memory_gib:g}"] + (
            ["--host-memory-gib", f"{args.host_memory_gib:g}"] if args.host_memory_gib else []) + (
            ["--profile", profile] if profile else [])
        other_pricing = bool(args.host_memory_gib or profile)
        own_setting = args.gpu_memory_gib == 80 and not other_pricing  # the verdict's own: 80 GiB, no host tier
        out = Path(args.out) if args.out else (OUT if own_setting else HOST_OUT if other_pricing else MEMORY_OUT)
        for name, lengths in held_out_batches(args.n).items():
            rows.append(row(name, lengths, Path(tmp), extra, args.flexsp_milp, args.host_memory_gib, profile,
                            with_what_if=own_setting))
    mins = [r["min_over_alternatives"] for r in rows if "min_over_alternatives" in r]
    result = {"model": "llama2-13b", "world_size": 8, "gpus_per_node": 8, "gpu_memory_gib": args.gpu_memory_gib,
              "seed": SEED,
              "host_memory_gib": args.host_memory_gib, "profile": described,
              "rows": rows, "every_alternative_at_least_1": all(m >= 1.0 for m in mins),
              "geo_mean_of_min": math.exp(sum(math.log(m) for m in mins) / len(mins)),
              "max_search_wall_s": max(r["search_wall_s"] for r in rows),
              "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
              "note": "simulated tokens/s (cost model, shipped default profile); search times measured on the "
                      "machine running this, under the load recorded"}
    save(out, result, keyed=not own_setting)
    print(json.dumps({k: result[k] for k in ("every_alternative_at_least_1", "geo_mean_of_min", "max_search_wall_s",
                                             "load_average_at_start")}))


if __name__ == "__main__":
    main()
