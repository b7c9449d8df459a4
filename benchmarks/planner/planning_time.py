"""EPP's planning time, with elastic SP rounds and without, on the planner benchmark's batches.

The planner benchmark's 512-sequence batches (``planner_tables/setups.py``) planned by EPP on every
``pp x sp`` split of its GPUs (Llama-2-7B on 4 GPUs, Llama-2-13B on 8, states sharded over SP at
sp > 1; sp 1 is ``pp = GPUs``, where 13B pp 8 plans are the slowest: the goal is 5 s worst), and
the paper layout's batches (pp 4 x sp 8, 7B/13B/30B, 48K/96K caps).  Each plan is timed once per
variant:

- ``rounds``: EPP as it plans by default (elastic SP rounds at sp > 1, none at sp 1);
- ``whole_groups``: ``sp_rounds=False``;
- ``--label NAME``: the default EPP of the code on ``PYTHONPATH`` (another checkout, e.g.
  ``git archive HEAD infinipipe_hf | tar -x -C /tmp/head``), stored as variant ``NAME``.

    python -m benchmarks.planner.planning_time                       # rounds and whole_groups
    python -m benchmarks.planner.planning_time --rounds-only         # the default variant alone
    PYTHONPATH=/tmp/head:$PWD python -P -m benchmarks.planner.planning_time --label before

(``-P``: the working directory does not go first on the module search path, so ``infinipipe_hf``
comes from /tmp/head and ``benchmarks`` from ``$PWD``.)

Each run adds its variants to ``benchmarks/results/planner_planning_time.json`` (mean and worst
per variant, and every plan's time).  Times are wall-clock on the machine that runs it and depend
on its load (the JSON records the load average at start and end).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.data import synthetic
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.api import plan_step


def _setups():
    """``planner_tables/setups.py`` alone (the package's tables import today's planner API, which an
    older checkout timed with ``--label before`` lacks)."""
    spec = importlib.util.spec_from_file_location("planner_setups", Path(__file__).parent / "planner_tables" / "setups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETUPS, batches = _setups().SETUPS, _setups().batches


def spec_of(model: str) -> ModelSpec:
    return ModelSpec.from_json_file(config_path(model))

OUT = RESULTS / "planner_planning_time.json"
PAPER_MODELS = ("llama2-7b", "llama2-13b", "llama-30b")
PAPER_CAPS = (48 * 1024, 96 * 1024)
SP_DEGREES = (1, 2, 4, 8)


def cases(quick: bool, with_sp1: bool = True) -> list[tuple[str, str, int, int, list[int]]]:
    """``(setting, model, pp, sp, lengths)`` of every plan timed (``with_sp1``: also ``pp = GPUs``,
    sp 1: the 13B pp 8 plans are the slowest)."""
    out = []
    for model, gpus in (SETUPS[:1] if quick else SETUPS):
        for name, lengths in batches(quick).items():
            for sp in (d for d in SP_DEGREES if gpus % d == 0 and (with_sp1 or d > 1)):
                out.append((f"bench {name}", model, gpus // sp, sp, lengths))
    for cap in PAPER_CAPS[:1] if quick else PAPER_CAPS:
        lengths = synthetic.slimpajama_like(n=512, max_len=cap, seed=0)
        for model in PAPER_MODELS[:1] if quick else PAPER_MODELS:
            out.append((f"paper layout {cap // 1024}K", model, 4, 8, lengths))
    return out


def _new_api() -> bool:
    """Whether this checkout's ``plan_step`` takes a layout object and options (else the degrees
    and options as keywords, as older checkouts timed with ``--label before`` do)."""
    return "options" in inspect.signature(plan_step).parameters


def _has_option(name: str) -> bool:
    if _new_api():
        from infinipipe_hf.planner.search.api import PlanOptions

        return name in PlanOptions.__dataclass_fields__
    return name in inspect.signature(plan_step).parameters


def _plan_epp(lengths, spec, pp: int, sp: int, kw: dict):
    """EPP's plan of one case on ``pp x sp`` with states sharded over SP (unsharded at sp 1), 80 GiB per GPU."""
    if _new_api():
        from infinipipe_hf.layout import ParallelDims
        from infinipipe_hf.planner.search.api import PlanOptions

        dims = ParallelDims(pp, sp, 1, "sp" if sp > 1 else "none")
        cost = CostModel(spec, None, dims, memory_budget_bytes=80 * GIB)
        return plan_step(lengths, spec, dims, PlanOptions(schedule="epp", **kw), cost=cost)
    shard = "sp" if sp > 1 else "none"
    cost = CostModel(spec, None, pp_degree=pp, sp_degree=sp, shard=shard, memory_budget_bytes=80 * GIB)
    return plan_step(lengths, spec, pp_degree=pp, dp_degree=1, sp_degree=sp, shard=shard, schedule="epp", cost=cost,
                     **kw)


def time_variant(rounds: bool | None, quick: bool, with_sp1: bool = True) -> dict:
    """Plan every case once; ``rounds`` None: the code's default (no ``sp_rounds`` argument)."""
    kw = {} if rounds is None else {"sp_rounds": rounds}
    if kw and not _has_option("sp_rounds"):
        raise SystemExit("this checkout's plan_step has no sp_rounds; run it with --label before")
    rows = []
    for setting, model, pp, sp, lengths in cases(quick, with_sp1):
        spec = spec_of(model)
        t0 = time.perf_counter()
        res = _plan_epp(lengths, spec, pp, sp, kw)
        elapsed = time.perf_counter() - t0
        d = res.summary()
        rows.append({"setting": setting, "model": model, "pp": pp, "sp": sp, "num_sequences": len(lengths),
                     "planning_time_s": elapsed, "tokens_per_s": d["tokens_per_s"],
                     "sp_rounds": d.get("info", {}).get("sp_rounds"), "load_average_1min": os.getloadavg()[0]})
        print(f"  {setting:<36} {model:>10} pp{pp} sp{sp}: {elapsed:.2f} s, {d['tokens_per_s'] / 1e3:.1f}K tok/s",
              flush=True)
    times = [r["planning_time_s"] for r in rows]
    worst = max(rows, key=lambda r: r["planning_time_s"])
    return {"mean_s": statistics.mean(times), "median_s": statistics.median(times), "max_s": worst["planning_time_s"],
            "worst_case": {k: worst[k] for k in ("setting", "model", "pp", "sp")}, "plans": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default=None,
                   help="time this checkout's default EPP under this name (no sp_rounds argument), e.g. 'before' "
                        "for another checkout on PYTHONPATH")
    p.add_argument("--no-sp1", action="store_true", help="only sp > 1 (pp x sp splits), as before sp 1 was timed")
    p.add_argument("--rounds-only", action="store_true", help="time the default variant (rounds) alone")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {"variants": {}}
    variants = {args.label: None} if args.label else {"rounds": None, "whole_groups": False}
    if args.rounds_only and not args.label:
        del variants["whole_groups"]
    for name, rounds in variants.items():
        print(f"== {name}", flush=True)
        load = os.getloadavg()
        report["variants"][name] = {**time_variant(rounds, args.quick, not args.no_sp1), "load_average_start": load[0],
                                    "load_average_end": os.getloadavg()[0], "quick": args.quick}
    report.update(machine=platform.platform(), cpus=os.cpu_count(),
                  note="wall-clock planning time of EPP, one plan per case; the machine is shared, see load_average")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for name, v in report["variants"].items():
        print(f"{name}: mean {v['mean_s']:.2f} s, worst {v['max_s']:.2f} s ({v['worst_case']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
