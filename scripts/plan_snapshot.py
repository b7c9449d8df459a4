"""Snapshot the planner's outputs on fixed batches, to check that a refactor changes no plan.

    python scripts/plan_snapshot.py write OUT.json     # plan every case, write the snapshot
    python scripts/plan_snapshot.py compare OUT.json   # re-plan, print every difference, exit 1 if any

``PLAN_SNAPSHOT_EXTRA_ARGS`` (environment) adds CLI flags to every case without recording them,
e.g. ``PLAN_SNAPSHOT_EXTRA_ARGS=--no-sp-rounds`` compares plans with elastic SP rounds switched off.

Only stable entry points are used: the planner CLI ``python -m infinipipe_hf.plan --json
--emit-plan`` (docs/contracts.md) run as a subprocess, and ``import infinipipe_hf`` to find the
shipped model configs (by file name anywhere under the package, so moving them inside it is fine;
a copy of each config is kept in the snapshot and used when the file is gone).  Batches are
generated here, deterministically, and stored in the snapshot too.

Each case records the CLI's exit status and stderr (its temporary folder written as ``<tmp>``),
its full ``--json`` output and every plan file
it emits (``--schedule all`` writes ``plan.json`` plus ``plan.<schedule>.json``), compared exactly
(floats too) except:
  planning_time_s (anywhere in ``--json``) -- wall-clock planning time: dropped, never compared.
  EPP with adaptive checkpointing, unless its method is ``none-needed``: each EPP plan's
    checkpoint_layers / checkpoint_levels, info.{checkpoint_method, checkpoint_note,
    recompute_time_s}, and the summary's step_time_s, tokens_per_s, bubble_fraction,
    peak_memory_bytes, recompute_time_s, recompute_fraction (+ the same info keys).  The final
    checkpointing solve runs a MILP under a 0.25 s wall-clock limit (plan_step's
    solver_time_limit_s, not a CLI flag), so these differ between identical runs on a loaded
    machine.  They are kept under ``milp_timed``; compare lists the cases where they differ
    (a count per case) without failing.
"""
from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import infinipipe_hf

EXCLUDED = ("planning_time_s",)
SUMMARY_TIMED = ("step_time_s", "tokens_per_s", "bubble_fraction", "peak_memory_bytes", "recompute_time_s",
                 "recompute_fraction")
PLAN_TIMED = ("checkpoint_layers", "checkpoint_levels")
INFO_TIMED = ("checkpoint_method", "checkpoint_note", "recompute_time_s")
MODELS = {"llama3.2-1b": "24", "llama2-7b": "80"}  # model -> --memory-budget-gib (so recompute happens)
LAYOUTS = {
    "sp1": ["--pp", "4"],
    "sp1-dp2": ["--pp", "4", "--world-size", "8"],
    "sp8": ["--pp", "2", "--sp", "8", "--world-size", "16"],
    "sp8-shard-sp": ["--pp", "2", "--sp", "8", "--world-size", "16", "--shard", "sp"],
}
LEVELS = {"levels-default": [], "levels-none": ["--checkpoint-levels", "none"]}  # default: all levels
SCHEDULES = ("epp", "packed-1f1b", "seq1f1b", "gpipe", "ulysses-zero3", "ring-cp", "flexsp")
REPO = Path(__file__).resolve().parent.parent


def make_batches() -> dict[str, list[int]]:
    """Three fixed global batches (only ``Random.random`` is used: stable across Python versions)."""
    rng = random.Random(20240611)
    # Long-tailed: Pareto-like, 160 sequences from 128 up to 40K tokens.
    long_tail = [min(40960, int(128 * (1.0 - rng.random()) ** -1.25)) for _ in range(160)]
    long_tail[rng.randrange(160)] = 40960  # make sure the tail reaches the cap
    short = [128 + int(1920 * rng.random()) for _ in range(64)]
    one_long = [256 + int(1792 * rng.random()) for _ in range(40)]
    one_long.insert(17, 98304)
    return {"long-tail": long_tail, "short": short, "one-long": one_long}


def find_configs(stored: dict | None = None) -> dict[str, dict]:
    """Each model's HF config, from the file ``<model>.json`` anywhere under the package."""
    root = Path(infinipipe_hf.__file__).resolve().parent
    configs = {}
    for model in MODELS:
        hits = sorted(p for p in root.rglob(f"{model}.json") if "model_type" in json.loads(p.read_text()))
        if len(hits) > 1:
            sys.exit(f"several configs named {model}.json under {root}: {hits}")
        if not hits and not (stored and model in stored):
            sys.exit(f"no config {model}.json under {root}")
        if not hits:
            print(f"warning: {model}.json not under {root}; using the snapshot's copy", file=sys.stderr)
        configs[model] = json.loads(hits[0].read_text()) if hits else stored[model]
    return configs


def build_cases() -> dict[str, list[str]]:
    """Case name -> CLI arguments besides --model/--lengths/--json/--emit-plan."""
    cases = {}
    for model, mem in MODELS.items():
        for batch in ("long-tail", "short", "one-long"):
            for layout, largs in LAYOUTS.items():
                for level, vargs in LEVELS.items():
                    cases[f"{model}/{batch}/{layout}/{level}"] = [
                        model, batch, *largs, "--memory-budget-gib", mem, "--schedule", "all", *vargs]
    base = ["llama3.2-1b", "long-tail", "--pp", "4"]
    for s in SCHEDULES:  # the single-schedule output form (an object, plan at the exact path)
        cases[f"llama3.2-1b/long-tail/sp1/only-{s}"] = [*base, "--memory-budget-gib", "24", "--schedule", s]
    extras = {"checkpointing-none-80g": ["--memory-budget-gib", "80", "--checkpointing", "none"],
              "checkpointing-none": ["--memory-budget-gib", "24", "--checkpointing", "none"],  # infeasible
              "checkpointing-full": ["--memory-budget-gib", "24", "--checkpointing", "full"],
              "levels-keep_attn": ["--memory-budget-gib", "24", "--checkpoint-levels", "keep_attn"],
              "max-tokens-8192": ["--memory-budget-gib", "24", "--max-tokens-per-unit", "8192"]}
    for name, args in extras.items():
        cases[f"llama3.2-1b/long-tail/sp1/{name}"] = [*base, *args, "--schedule", "all"]
    return cases


def strip(obj):
    """``obj`` without the EXCLUDED keys, at any depth."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in EXCLUDED}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def _pop(d: dict, keys: tuple, info_keys: tuple) -> dict:
    out = {k: d.pop(k) for k in keys if k in d}
    info = d.get("info", {})
    return {**out, **{f"info.{k}": info.pop(k) for k in info_keys if k in info}}


def split_timed(result: dict) -> None:
    """Move what the time-bounded MILP decides (EPP, adaptive checkpointing) to ``milp_timed``:
    every EPP plan's and summary's (``--schedule all`` with SP rounds plans EPP twice).  Idempotent,
    so a snapshot written before every EPP plan was split is split again on compare."""
    flags = result["args"][2:]
    if "--checkpointing" in flags and flags[flags.index("--checkpointing") + 1] != "adaptive":
        return
    epp = [(name, p) for name, p in result["plans"].items() if p.get("schedule") == "epp"]
    if not epp or epp[0][1].get("info", {}).get("checkpoint_method") == "none-needed":
        return
    summaries = result["json"] if isinstance(result["json"], list) else [result["json"]]
    timed = result.setdefault("milp_timed", {})
    for i, summary in enumerate(s for s in summaries if s.get("schedule") == "epp"):
        moved = _pop(summary, SUMMARY_TIMED, INFO_TIMED)
        if moved:
            timed["json" if i == 0 else f"json/{i}"] = moved
    for name, plan in epp:
        moved = _pop(plan, PLAN_TIMED, INFO_TIMED)
        if moved:
            timed[f"plans/{name}"] = moved


def run_case(args: list[str], inputs: dict) -> dict:
    model, batch, *flags = args
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(inputs["configs"][model]))
        (tmp / "lengths.txt").write_text("\n".join(map(str, inputs["batches"][batch])) + "\n")
        plans = tmp / "plans"
        plans.mkdir()
        extra = shlex.split(os.environ.get("PLAN_SNAPSHOT_EXTRA_ARGS", ""))
        cmd = [sys.executable, "-m", "infinipipe_hf.plan", "--model", str(tmp / "config.json"),
               "--lengths", str(tmp / "lengths.txt"), *flags, *extra, "--json", "--emit-plan", str(plans / "plan.json")]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        out = {"args": args, "returncode": proc.returncode, "stderr": proc.stderr.replace(str(tmp), "<tmp>")}
        out["json"] = strip(json.loads(proc.stdout)) if proc.returncode == 0 else proc.stdout
        out["plans"] = {p.name: json.loads(p.read_text()) for p in sorted(plans.iterdir())}
    split_timed(out)
    return out


def compute(stored_configs: dict | None = None) -> dict:
    inputs = {"configs": find_configs(stored_configs), "batches": make_batches()}
    cases = build_cases()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:  # each case is its own CLI process
        results = dict(zip(cases, pool.map(lambda a: run_case(a, inputs), cases.values())))
    print(f"planned {len(cases)} cases in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {"excluded_fields": list(EXCLUDED), "inputs": inputs, "cases": results}


def diff(a, b, path: str = "") -> list[str]:
    """Every difference between two JSON values, as 'path: old != new' lines (floats exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        short = lambda d, k: json.dumps(d[k])[:300] if k in d else "<missing>"  # noqa: E731
        return [line for k in sorted(set(a) | set(b)) for line in (
            diff(a[k], b[k], f"{path}/{k}") if k in a and k in b else [f"{path}/{k}: {short(a, k)} != {short(b, k)}"])]
    if isinstance(a, list) and isinstance(b, list):
        out = [f"{path}: length {len(a)} != {len(b)}"] if len(a) != len(b) else []
        return out + [line for i, (x, y) in enumerate(zip(a, b)) for line in diff(x, y, f"{path}[{i}]")]
    if type(a) is not type(b) or a != b:
        return [f"{path}: {json.dumps(a)} != {json.dumps(b)}"]
    return []


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, path = argv
    if mode == "write":
        snap = compute()
        Path(path).write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(snap['cases'])} cases to {path} ({Path(path).stat().st_size:,} bytes)")
        return 0
    old = json.loads(Path(path).read_text())
    new = json.loads(json.dumps(compute(old["inputs"]["configs"])))  # same float round trip as old
    for case in old["cases"].values():
        split_timed(case)
    timed = {n: (c.pop("milp_timed", None), new["cases"].get(n, {}).pop("milp_timed", None))
             for n, c in old["cases"].items()}
    lines = diff(old, new)
    for line in lines:
        print(line)
    soft = {n: diff(a, b) for n, (a, b) in timed.items() if a is not None and b is not None}
    for name, fields in soft.items():
        if fields:
            print(f"not counted: /cases/{name}/milp_timed: {len(fields)} field(s) differ (MILP time limit)")
    print(f"{len(lines)} difference(s) (snapshot != now)" if lines else "identical",
          f"({sum(map(bool, soft.values()))} case(s) with MILP-timed differences, not counted)")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
