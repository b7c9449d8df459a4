"""``python -m infinipipe_hf.plan --search-layout``: which ``pp x sp x dp x shard`` to run.

Plans the batch with EPP on every layout of ``--world-size`` GPUs (``--gpus-per-node`` per node)
that can run, and each non-pipeline alternative (ulysses-zero3, ring-cp, flexsp) at its best on
the same GPUs (:mod:`infinipipe_hf.planner.layout_search.search`); prints a table, or with ``--json``
``{"recommended": {...}, "layouts": [...], "alternatives": [...], "search_time_s", ...}``, and
the recommended layout as ``EPPTrainingArguments`` fields and recipe flags that reproduce its plan
in the trainer (the degrees, ``tokens_per_step``, ``memory_budget_gib``: the exact budget planned
to, and every planning option given), and the planner command that replans it alone (same
tokens/s).  The budget is the trainer's rule on ``--gpu-memory-gib`` (or ``--memory-budget-gib``),
printed and in the JSON beside ``memory_budget_bytes`` (``device_memory_bytes``, ``memory_margin``,
``memory_reserve_bytes``).  With ``--host-memory-gib`` the layouts are also planned with their model
states in host memory (``state_offload`` modes, like shard modes; ``--state-offload`` restricts
them) and the host peak is printed beside the GPU peak; with one sequence in ``--lengths`` each
layout's largest trainable length with and without the host tier is reported (``largest_length``,
``largest_length_without_offload``).  ``--sp`` / ``--shard`` restrict the search; ``--pp`` and
``--dp`` are what it chooses and are refused.  ``--emit-plan`` / ``--plot`` write the recommended
layout's plan / Gantt chart.  Exit status: 0, 2 for input errors, 1 when no layout fits (the
message names each layout's largest trainable sequence; with ``--json`` the object still prints,
``recommended`` null and ``error`` set).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from infinipipe_hf.cli.inputs import (
    host_budget_bytes,
    host_flags,
    host_note,
    length_warnings,
    memory_budget,
    memory_flags,
    plan_option_flags,
    plan_options,
    read_lengths,
    read_model_spec,
    read_profile,
)
from infinipipe_hf.cli.native_output import native_output_to_stderr
from infinipipe_hf.planner.cost.calibration import pricing_record
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.result import LayoutSearch, NoLayoutFits, plan_flags
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.layout_search.table import format_search
from infinipipe_hf.planner.registry import ALTERNATIVES, REFERENCE


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The layout-search flags of the planner CLI."""
    p.add_argument("--search-layout", action="store_true",
                   help="plan EPP on every pp x sp x dp x shard of --world-size GPUs (and the non-pipeline "
                        "alternatives at their best) and recommend the fastest that fits; no --pp")
    p.add_argument("--search-workers", type=int, default=min(os.cpu_count() or 1, 8), metavar="N",
                   help="processes planning layouts in parallel with --search-layout (default: the CPUs, at "
                        "most 8; 1 plans in this process)")


def check_search_args(args: argparse.Namespace) -> None:
    """``ValueError`` for flags the layout search cannot take."""
    chosen = [f"{flag} {value}" for flag, value in (("--pp", args.pp), ("--dp", args.dp)) if value is not None]
    if chosen:
        raise ValueError(f"--search-layout chooses pp, sp, dp and shard itself; drop {' and '.join(chosen)} "
                         f"(or drop --search-layout to plan that layout)")
    if args.world_size is None:
        raise ValueError("--search-layout needs --world-size: the number of GPUs of the job")
    if args.schedule != REFERENCE:
        raise ValueError(f"--search-layout plans EPP on every layout and compares the non-pipeline alternatives "
                         f"itself; drop --schedule {args.schedule}")
    if args.search_workers < 1:
        raise ValueError(f"--search-workers must be >= 1, got {args.search_workers}")
    if args.sp is not None and args.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {args.sp}")


def run_search(args: argparse.Namespace) -> LayoutSearch:
    """The layout search the flags ask for (``NoLayoutFits`` when no layout fits)."""
    check_search_args(args)
    spec = read_model_spec(args.model)
    lengths = read_lengths(args.lengths)
    budget = args.budget = memory_budget(args)
    host = args.host_bytes = host_budget_bytes(args)
    args.warnings = length_warnings(spec, lengths)
    profile = read_profile(args.profile) if args.profile else None
    try:
        search = search_layouts(lengths, spec, world_size=args.world_size, gpus_per_node=args.gpus_per_node,
                                memory_budget_bytes=budget.budget_bytes, profile=profile,
                                sp_degrees=None if args.sp is None else (args.sp,),
                                shards=None if args.shard is None else (args.shard,),
                                plan_options=plan_options(args), workers=args.search_workers, host_budget_bytes=host,
                                state_offloads=None if args.state_offload is None else (args.state_offload,))
    except NoLayoutFits as exc:
        _add_inputs(args, exc.search)
        exc.search.extra["error"] = str(exc)
        raise
    _add_inputs(args, search)
    best = search.recommended.layout
    options = " ".join(f for f in (host_flags(args), plan_option_flags(args)) if f)
    offload = f" --state-offload {best.state_offload}" if best.state_offload.offloaded else ""
    adopted = search.recommended_settings().get("adopt_rounds_of")
    if adopted and not getattr(args, "adopt_rounds_of", ""):  # the pick replans with the alternatives it adopted
        offload += f" --adopt-rounds-of {','.join(adopted)}"
    search.extra["plan_command"] = (f"python -m infinipipe_hf.plan --model {args.model} --lengths {args.lengths} "
                                    f"{plan_flags(best)}{offload} --world-size {search.world_size} --gpus-per-node "
                                    f"{search.gpus_per_node} {memory_flags(args)} {options + ' ' if options else ''}"
                                    f"--schedule epp")
    return search


def _add_inputs(args: argparse.Namespace, search: LayoutSearch) -> None:
    """The budget's keys, the input warnings and the profile file (a recipe setting) on ``search``."""
    search.extra.update({k: v for k, v in args.budget.to_dict().items() if k != "memory_budget_bytes"})
    if args.warnings:
        search.extra["warnings"] = list(args.warnings)
    if args.profile:
        search.settings["profile"] = args.profile
    profile = read_profile(args.profile) if args.profile else default_profile()
    search.extra["pricing"] = pricing_record(profile, ALTERNATIVES)  # which efficiencies priced the table


def _write_outputs(args: argparse.Namespace, search: LayoutSearch) -> None:
    result = search.recommended.result
    if args.emit_plan:
        Path(args.emit_plan).write_text(result.plan.to_json(indent=1))
    if args.plot:
        from infinipipe_hf.cli.viz import plot_plan

        lay = search.recommended.layout
        plot_plan(result.plan, result.simulation, args.plot,
                  title=f"epp: {Path(args.model).name}, {lay.label}, shard {lay.shard}")


def search_main(args: argparse.Namespace) -> int:
    """Run the layout search for the CLI; the exit status."""
    try:
        with native_output_to_stderr():
            search = run_search(args)
    except NoLayoutFits as exc:
        _print(args, exc.search)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _write_outputs(args, search)
    _print(args, search)
    return 0


def _print(args: argparse.Namespace, search: LayoutSearch) -> None:
    for warning in args.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(search.to_dict(), indent=1))
    else:
        print(format_search(search))
        note = host_note(getattr(args, "host_bytes", 0.0))
        if note:
            print(note)
        print(f"memory budget planned to: {args.budget.describe()}")
