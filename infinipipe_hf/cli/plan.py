"""``python -m infinipipe_hf.plan``: plan one global batch and compare schedules (docs/contracts.md).

Reads an HF ``config.json`` and a file of sequence lengths (one per line), plans the batch with one
schedule or all of them under the same cost model, and prints a table (or ``--json``: one object
per schedule, a list for ``all``).  ``--emit-plan`` writes the plan as JSON; with ``--schedule all``
the EPP plan goes to the given path and each baseline's next to it as ``<stem>.<schedule>.json``.
``--plot`` draws the Gantt chart with memory curves (one PNG per schedule likewise).

Layout: ``--sp`` GPUs per stage share every unit (Ulysses sequence parallelism), ``--shard``
shards model states (FSDP2) over the stage's SP group, DP replicas or both, ``--gpus-per-node``
says which groups cross nodes; ``--world-size`` checks ``pp x sp`` against a job's world and
derives ``--dp``.  ``--schedule all`` plans every schedule with the same layout.  Times, bytes
and the memory budget are per GPU.

Memory: ``--gpu-memory-gib`` is the GPU's memory; the plan stays under it less
``--memory-margin`` and ``--memory-reserve-gib`` (the trainer's ``memory_margin`` and
``memory_reserve_gib``, same defaults, same rule: ``InfiniPipeConfig.memory_budget``), or under
``--memory-budget-gib`` exactly.  The table and the JSON say the budget planned to.  Sequences
longer than the model's ``max_position_embeddings`` are warned about (stderr, ``warnings`` in the
JSON): the trainer would cut or refuse them.

Host memory: ``--host-memory-gib`` is the host memory per GPU the plan may use (default 0: no
host tier, the planner does not see the machine); with it the plan may keep layer inputs and K/V
in host memory, and ``--state-offload`` puts model states there.  The table and the JSON
(``host_peak_memory_bytes``, ``host_memory_budget_bytes``, ``state_offload``) give the host peak
beside the GPU peak (``peak_memory_bytes`` stays the GPU's).

``--search-layout --world-size N`` (no ``--pp``) plans EPP on every ``pp x sp x dp x shard`` of
N GPUs instead and recommends one (:mod:`infinipipe_hf.cli.plan_layouts`).

The users' alternatives that are not pipelines (``ulysses-zero3``, ``ring-cp``, ``flexsp``; see
``infinipipe_hf.planner.alternatives``) are planned on the same ``pp x sp x dp`` GPUs, every GPU
running every layer with ZeRO-3 states; ``--schedule all`` includes them after the pipeline
schedules.  Their ``--emit-plan`` is their own round form (``RoundPlan.to_dict``: groups of GPUs
and the sequences each runs per round); ``--plot`` draws pipelines only and skips them.

Input errors (missing files, a directory without ``config.json``, invalid JSON, unsupported model,
missing config keys, bad lengths) exit with status 2 and a message on stderr naming the file;
``--model`` may be an HF checkpoint directory (its ``config.json`` is read).  A batch that no plan
fits is not an input error: it is reported as ``feasible: false`` with an ``error`` naming what
does not fit.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infinipipe_hf.cli.inputs import (
    add_host_arguments,
    add_memory_arguments,
    host_budget_bytes,
    host_note,
    length_warnings,
    memory_budget,
    plan_options,
    read_lengths,
    read_model_spec,
    read_profile,
)
from infinipipe_hf.cli.native_output import native_output_to_stderr
from infinipipe_hf.cli.plan_layouts import add_search_arguments, search_main
from infinipipe_hf.cli.viz import format_host_copies
from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.ir.grad_reduce import GRAD_REDUCE_CHOICES
from infinipipe_hf.ir.levels import CHECKPOINTING, FINER_LEVELS
from infinipipe_hf.layout import SHARD_MODES, ParallelDims
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.host_tier import (
    alternative_knobs,
    host_peak_bytes,
    offload_runs,
    planned_alternatives,
)
from infinipipe_hf.planner.registry import ALTERNATIVES, PIPELINE_SCHEDULES, REFERENCE, get_schedule
from infinipipe_hf.planner.schedules.base import ROUNDS
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step, resolve_sp_rounds
from infinipipe_hf.planner.search.result import PlanResult


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infinipipe_hf.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF config.json of the model, or a checkpoint directory")
    p.add_argument("--lengths", required=True, help="text file: one sequence length per line (one global batch)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (pp_degree; required unless "
                   "--search-layout)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (dp_degree; default 1, "
                   "or world size / (pp x sp) with --world-size)")
    p.add_argument("--sp", type=int, default=None, help="GPUs per stage sharing each unit (sp_degree, Ulysses; "
                   "default 1; with --search-layout: search only this sp)")
    p.add_argument("--shard", default=None, choices=SHARD_MODES,
                   help="shard model states (FSDP2) over the stage's SP group (sp), DP replicas (dp), "
                        "both (sp+dp), or over SP replicated over DP (hybrid); default none; with "
                        "--search-layout: search only this mode")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: the profile's, 8): groups crossing nodes use the "
                        "inter-node bandwidth")
    p.add_argument("--world-size", type=int, default=None,
                   help="total GPUs of the job: checked against pp x sp (x dp)")
    add_memory_arguments(p)
    add_host_arguments(p)
    p.add_argument("--profile", default=None, help="cost profile JSON, or a shipped one by name: 'default' (H100/bf16 "
                   "calibrated, what no --profile uses) or 'uncalibrated' (the layer fit alone)")
    p.add_argument("--schedule", default=REFERENCE, choices=[*PIPELINE_SCHEDULES, *ALTERNATIVES, "all"],
                   help="a pipeline schedule, a non-pipeline alternative on the same GPUs, or all of them")
    p.add_argument("--sp-rounds", action=argparse.BooleanOptionalAction, default=None,
                   help="EPP: run short sequences on SP sub-groups in rounds (default: whenever --sp > 1 is a "
                        "power of two); --no-sp-rounds runs every unit on the whole SP group")
    p.add_argument("--grad-reduce", default="auto", choices=list(GRAD_REDUCE_CHOICES),
                   help="when sharded stages reduce-scatter gradients: step (once per step), unit (after every "
                        "unit's backward; shard groups over SP only) or auto (default: both priced where unit "
                        "runs, the faster kept; the JSON's grad_reduce says which)")
    p.add_argument("--adopt-rounds-of", default="", metavar="ALTERNATIVES",
                   help="EPP at pp 1, dp 1: also plan these non-pipeline alternatives' own rounds as candidates "
                        "(comma-separated among flexsp, ulysses-zero3, ring-cp-packed; the layout search's "
                        "recipe sets it where one plans faster than EPP's own search)")
    p.add_argument("--max-tokens-per-unit", type=int, default=None)
    p.add_argument("--checkpointing", default="adaptive", choices=list(CHECKPOINTING))
    p.add_argument("--checkpoint-levels", default=",".join(FINER_LEVELS), metavar="LEVELS",
                   help="levels inside a decoder layer adaptive checkpointing may use beside whole "
                        f"layers: comma-separated among {', '.join(FINER_LEVELS)}, or 'none' (whole layers only)")
    p.add_argument("--solver-time-limit-s", type=float, default=0.0, metavar="S",
                   help="seconds adaptive checkpointing may spend in HiGHS' branch and bound per plan (default 0: "
                        "none, so the plan does not depend on this machine's speed or load)")
    p.add_argument("--emit-plan", default=None, metavar="PLAN.json", help="write the plan as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="Gantt chart + memory per stage")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    add_search_arguments(p)
    return p


def run(args: argparse.Namespace) -> list[PlanResult]:
    """Plan the batch with every schedule asked for, in order (pipeline schedules, then alternatives).
    Sets ``args.budget`` (the budget planned to) and ``args.warnings`` (about the lengths)."""
    spec = read_model_spec(args.model)
    lengths = read_lengths(args.lengths)
    profile = read_profile(args.profile) if args.profile else default_profile()
    dims = args.dims = resolve_layout(args, profile)
    args.budget = memory_budget(args)
    args.warnings = length_warnings(spec, lengths)
    cost = CostModel(spec, profile, dims, memory_budget_bytes=args.budget.budget_bytes,
                     host_budget_bytes=args.host_bytes)
    schedules = ((*PIPELINE_SCHEDULES, *planned_alternatives(args.host_bytes)) if args.schedule == "all"
                 else (args.schedule,))
    options = plan_options(args)
    results = []
    flat = None
    for s in schedules:
        if get_schedule(s).kind == ROUNDS:
            if flat is None:
                flat = _flat_cost(args, spec, cost)
            results.append(plan_alternative(lengths, spec, s, world_size=flat.world_size, cost=flat,
                                            checkpointing=args.checkpointing,
                                            **alternative_knobs(s, args.host_bytes)))
            continue
        results.extend(_plan_pipeline(lengths, spec, args, s, cost, options))
    return results


def _plan_pipeline(lengths, spec, args: argparse.Namespace, schedule: str, cost: CostModel,
                   options: dict) -> list[PlanResult]:
    """One pipeline schedule; with ``--schedule all`` and elastic SP rounds, also the schedule on
    whole SP groups (labelled), for comparison."""
    elastic = getattr(get_schedule(schedule), "elastic_sp_rounds", False)
    if args.schedule == "all" and not elastic:
        options = {**options, "sp_rounds": None}  # --sp-rounds is EPP's
    def plan(**opts) -> PlanResult:
        return plan_step(lengths, spec, cost.dims, PlanOptions(schedule=schedule, **opts), cost=cost)

    results = [plan(**options)]
    if args.schedule == "all" and resolve_sp_rounds(options.get("sp_rounds"), cost.dims.sp_degree, schedule):
        whole = plan(**{**options, "sp_rounds": False})
        whole.label = f"{schedule} (whole-group SP)"
        results.append(whole)
    return results


def _flat_cost(args: argparse.Namespace, spec, cost: CostModel) -> FlatCost:
    """The alternatives' cost on the pipeline layout's ``pp x sp x dp`` GPUs (warns that they
    ignore ``--max-tokens-per-unit``)."""
    flat = FlatCost.of(spec, cost.dims.world_size, args.budget.budget_bytes, cost.profile, cost.dims.gpus_per_node)
    if args.max_tokens_per_unit is not None:
        print(f"warning: --max-tokens-per-unit caps pipeline units; {', '.join(ALTERNATIVES)} "
              f"do not cut sequences and ignore it", file=sys.stderr)
    return flat


def pipeline_defaults(args: argparse.Namespace) -> None:
    """The one-layout defaults (``--sp 1``, ``--shard none``); ``--pp`` is required there."""
    if args.pp is None:
        raise ValueError("--pp is required (pipeline stages), or pass --search-layout --world-size N to "
                         "choose the layout")
    args.sp = 1 if args.sp is None else args.sp
    args.shard = "none" if args.shard is None else args.shard


def resolve_layout(args: argparse.Namespace, profile) -> ParallelDims:
    """The layout the flags describe, built once (``--gpus-per-node`` defaults to the profile's);
    with ``--world-size`` checked against the world as a launched job's is."""
    for flag, value in (("--pp", args.pp), ("--dp", args.dp), ("--sp", args.sp),
                        ("--gpus-per-node", args.gpus_per_node), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    gpn = profile.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    args.host_bytes = host_budget_bytes(args)
    offload = args.state_offload or "none"
    # The trainer's checks of the layout and the host tier (state offload as the runtime runs it).
    config = InfiniPipeConfig(pp_degree=args.pp, sp_degree=args.sp, dp_degree=args.dp, shard=args.shard,
                              state_offload=offload, host_memory_gib=args.host_memory_gib)
    if args.world_size is None:
        dims = ParallelDims(args.pp, args.sp, 1 if args.dp is None else args.dp, args.shard, gpn, offload)
    else:
        dims = config.layout(args.world_size, gpn)
    if not offload_runs(dims):
        raise ValueError(f"--state-offload states on unsharded stages runs FSDP2 on each GPU alone, which needs "
                         f"--sp 1 and --dp 1 (got {dims.label}); shard the stages (--shard sp, dp...) or use "
                         f"--state-offload optimizer")
    return dims


def _layout_title(dims: ParallelDims) -> str:
    return (f"pp={dims.pp_degree}, dp={dims.dp_degree}" + (f", sp={dims.sp_degree}" if dims.sp_degree != 1 else "")
            + (f", shard={dims.shard.name}" if dims.shard.sharded else "")
            + (f", state_offload={dims.state_offload}" if dims.state_offload.offloaded else ""))


def _sibling(path: str, schedule: str, first: bool) -> Path:
    p = Path(path)
    return p if first else p.with_name(f"{p.stem}.{schedule}{p.suffix}")


def format_table(results: list[PlanResult]) -> str:
    rows = [("schedule", "fits", "step s", "tokens/s", "bubble", "recompute s", "peak GiB", "host GiB", "units",
             "pipes", "plan s")]
    for r in results:
        d = r.summary()
        if r.feasible:
            rows.append((r.name, "yes", f"{d['step_time_s']:.3f}", f"{d['tokens_per_s']:,.0f}",
                         f"{d['bubble_fraction']:.3f}", f"{d['recompute_time_s']:.3f}",
                         f"{max(d['peak_memory_bytes']) / GIB:.1f}", f"{host_peak_bytes(r) / GIB:.1f}",
                         str(d["num_units"]), str(d["num_pipelines"]), f"{r.planning_time_s:.2f}"))
        else:
            rows.append((r.name, "NO", "-", "0", "-", "-", "-", "-", "-", "-", f"{r.planning_time_s:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    epp = next((r for r in results if get_schedule(r.schedule).reference and r.feasible), None)
    for label, names in (("the best pipeline baseline", PIPELINE_SCHEDULES),
                         ("the best non-pipeline alternative", ALTERNATIVES)):
        best = max((r.summary()["tokens_per_s"] for r in results
                    if not get_schedule(r.schedule).reference and r.schedule in names and r.feasible), default=0)
        if epp is not None and best > 0:
            lines.append(f"EPP speedup over {label}: {epp.summary()['tokens_per_s'] / best:.2f}x")
    whole = next((r for r in results if r.label and r.feasible), None)
    if epp is not None and whole is not None and whole.summary()["tokens_per_s"] > 0:
        lines.append(f"EPP speedup over {whole.name}: "
                     f"{epp.summary()['tokens_per_s'] / whole.summary()['tokens_per_s']:.2f}x")
    for r in results:
        copies = format_host_copies(r.simulation) if r.feasible else None
        if copies:
            lines.append(f"{r.name}: {copies}")
        if r.error:
            lines.append(f"{r.name}: {r.error}")
    return "\n".join(lines)


def report_written(args: argparse.Namespace, results: list[PlanResult]) -> None:
    """Name on stderr every file ``--emit-plan`` and ``--plot`` wrote (with ``--schedule all``,
    beside the given paths: ``<stem>.<schedule><suffix>``), so none is a surprise."""
    written = []
    for i, r in enumerate(results):
        if r.plan is None:
            continue
        if args.emit_plan:
            written.append(str(_sibling(args.emit_plan, r.file_name, i == 0)))
        if args.plot and get_schedule(r.schedule).kind != ROUNDS:
            written.append(str(_sibling(args.plot, r.file_name, i == 0)))
    if written:
        print(f"wrote {len(written)} file(s): {', '.join(written)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.search_layout:
        return search_main(args)
    try:
        pipeline_defaults(args)
        with native_output_to_stderr():
            results = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for i, r in enumerate(results):
        if r.plan is not None and args.emit_plan:
            _sibling(args.emit_plan, r.file_name, i == 0).write_text(r.plan.to_json(indent=1))
        if r.plan is not None and args.plot and get_schedule(r.schedule).kind == ROUNDS:
            print(f"note: --plot draws pipeline schedules; {r.schedule} is not one (skipped)", file=sys.stderr)
        elif r.plan is not None and args.plot:
            from infinipipe_hf.cli.viz import plot_plan

            plot_plan(r.plan, r.simulation, str(_sibling(args.plot, r.file_name, i == 0)),
                      title=f"{r.name}: {Path(args.model).name}, {_layout_title(args.dims)}")
    report_written(args, results)
    for warning in args.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        out = [with_budget(r.summary(), args, r) for r in results]
        print(json.dumps(out if args.schedule == "all" else out[0], indent=1))
    else:
        print(format_table(results))
        print(host_note(args.host_bytes) or f"host memory budget: {args.host_bytes / GIB:.4g} GiB per GPU "
                                             f"(--host-memory-gib), state offload: {args.dims.state_offload}")
        print(f"memory budget planned to: {args.budget.describe()}")
    return 0


def with_budget(summary: dict, args: argparse.Namespace, result: PlanResult | None = None) -> dict:
    """A schedule's ``--json`` object with the budget's keys (the budget planned to, also when no
    plan fits; the GPU's memory, margin and reserve), the host tier's (host peak, host budget,
    state offload) and the input ``warnings`` when there are any."""
    d = {**summary, **{k: v for k, v in args.budget.to_dict().items() if k != "memory_budget_bytes"}}
    d.setdefault("host_peak_memory_bytes", host_peak_bytes(result) if result is not None else 0.0)
    d.update(host_memory_budget_bytes=args.host_bytes, state_offload=args.dims.state_offload.name)
    if d.get("memory_budget_bytes") is None:
        d["memory_budget_bytes"] = args.budget.budget_bytes
    if args.warnings:
        d["warnings"] = list(args.warnings)
    return d


if __name__ == "__main__":
    sys.exit(main())
