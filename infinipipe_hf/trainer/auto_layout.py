"""``EPPTrainingArguments(pp_degree="auto")``: the trainer chooses its parallel layout at start-up.

The trainer takes the first global batches its training loader yields (same seed and order as
training), runs the planner's layout search on them over the launched processes (what
``python -m infinipipe_hf.plan --search-layout`` runs, without the non-pipeline alternatives),
logs the search's table and the choice, and sets ``pp_degree``, ``sp_degree``, ``dp_degree`` and
``shard`` on the arguments before the engine is built.  The loader's batches feed every DP
replica, so they depend on ``dp_degree``: each DP degree is searched on the batches the loader
forms for it, and a layout whose replicas a batch cannot feed is dropped with the reason in the
table.  The choice is the layout with the most tokens per second over its batches (total tokens
/ total step time) among those that fit every one of them.

``sp_degree`` and ``shard`` are searched when ``"auto"`` or left at their defaults (1,
``"none"``); another value restricts the search to it.  ``state_offload`` likewise: with a host
budget (``host_memory_gib``, by default the machine's share) the search also plans layouts with
model states in host memory unless ``state_offload`` names one mode, and plans every layout with
the host budget the engine will plan with.  Rank 0 searches and broadcasts the choice
(or its error), so every rank builds the same layout even when a solver stops on its wall-clock
limit, and an error is raised on every rank alike.
"""
from __future__ import annotations

import logging
import os

from infinipipe_hf.config import InfiniPipeConfig, plan_settings_of
from infinipipe_hf.layout import NO_SHARDING

AUTO = "auto"
SEARCH_BATCHES = 2
"""How many first global batches the search plans (each costs one search at start-up)."""

logger = logging.getLogger(__name__)


def is_auto(args) -> bool:
    return getattr(args, "pp_degree", None) == AUTO


def check_auto_fields(args) -> None:
    """The checks of an ``"auto"`` layout that need neither the data nor the world; ``ValueError``."""
    if not is_auto(args):
        for name in ("sp_degree", "shard", "dp_degree"):
            if getattr(args, name) == AUTO:
                raise ValueError(f"{name}='auto' needs pp_degree='auto' (the layout search chooses the degrees "
                                 f"together); set pp_degree='auto', or give {name} a value")
        return
    if args.dp_degree not in (None, AUTO):
        raise ValueError(f"pp_degree='auto' chooses dp_degree too; drop dp_degree={args.dp_degree!r}")
    if args.layer_split is not None:
        raise ValueError(f"pp_degree='auto' chooses the number of stages, so layer_split={args.layer_split} "
                         f"cannot be given; drop layer_split or set pp_degree")
    sp = args.sp_degree
    if sp != AUTO and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
        raise ValueError(f"sp_degree must be a positive integer or 'auto', got {sp!r}")
    from infinipipe_hf.trainer.pipeline_arguments import rename_in_message

    try:
        InfiniPipeConfig(**placeholder_kwargs(args))  # the other fields' checks, a shard mode's name among them
    except ValueError as exc:
        raise ValueError(rename_in_message(str(exc))) from None


def search_restrictions(args) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    """``(sp_degrees, shards)`` the search may use: None (every one) for "auto" or the default."""
    sp = None if args.sp_degree in (AUTO, 1) else (int(args.sp_degree),)
    shards = None if args.shard in (AUTO, NO_SHARDING.name) else (args.shard,)
    return sp, shards


def host_tier(args) -> tuple[float, tuple[str, ...] | None]:
    """``(host budget bytes, state-offload modes)`` of the search: the engine's host budget, and
    every mode unless ``state_offload`` names an offloading one."""
    from infinipipe_hf.runtime.engine.planning import host_budget_bytes

    host = host_budget_bytes(InfiniPipeConfig(**placeholder_kwargs(args)), args.device)
    mode = getattr(args, "state_offload", "none")
    return host, None if mode in (None, "none") else (mode,)


def first_batch_lengths(loader, count: int = SEARCH_BATCHES) -> list[list[int]]:
    """Sequence lengths of the first ``count`` global batches ``loader`` yields."""
    out = []
    for batch in loader:
        out.append([len(item["input_ids"]) for item in batch])
        if len(out) == count:
            break
    return out


def choose(batches, spec, args, world_size: int, gpus_per_node: int | None, memory_budget_bytes: float | None):
    """The layout search on the first batches; ``(Layout, table to log)``.

    ``batches``: the batches' sequence lengths, or ``dp_degree -> batches`` (the sampler's batches
    depend on how many replicas they feed, so each DP degree is searched on its own).  A layout
    must fit every batch of its DP degree; the pick has the most tokens per second over them (so
    with several batches every layout is planned in full: one pruned on a batch may win the sum).
    ``ValueError`` (the search's message) when no layout can run or none fits."""
    from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
    from infinipipe_hf.planner.layout_search.result import NoLayoutFits
    from infinipipe_hf.planner.layout_search.search import enumerate_layouts, rank_key, search_layouts
    from infinipipe_hf.planner.layout_search.table import format_search
    from infinipipe_hf.trainer.pipeline_arguments import config_kwargs

    batches_for = batches if callable(batches) else (lambda dp: batches)
    profile = HardwareProfile.load(args.profile) if args.profile is not None else default_profile()
    gpn = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    sp_degrees, shards = search_restrictions(args)
    host, offloads = host_tier(args)
    dps = sorted({lay.dp_degree for lay in enumerate_layouts(spec, world_size, gpn, sp_degrees=sp_degrees,
                                                             shards=shards)})
    options = plan_settings_of(config_kwargs(args))
    del options["schedule"]  # the search plans the reference schedule on every layout
    searches, rates, no_fit = [], [], None
    for dp in dps:
        dp_batches = batches_for(dp)
        totals: dict = {}
        for lengths in dp_batches:
            try:
                search = search_layouts(lengths, spec, world_size=world_size, gpus_per_node=gpn,
                                        memory_budget_bytes=memory_budget_bytes, profile=profile,
                                        sp_degrees=sp_degrees, shards=shards, alternatives=False,
                                        plan_options=options, dp_degrees=(dp,), host_budget_bytes=host,
                                        state_offloads=offloads, longest=False, prune=len(dp_batches) == 1)
            except NoLayoutFits as exc:
                search, no_fit = exc.search, no_fit or exc
            search.settings["tokens_per_step"] = args.tokens_per_step  # the run's, not this batch's count
            searches.append(search)
            for o in search.layouts:
                t = totals.setdefault(o.layout, [0, 0.0, o])
                if o.feasible:
                    t[0] += 1
                    t[1] += o.result.simulation.step_time_s
        tokens = sum(sum(b) for b in dp_batches)
        rates += [(tokens / t[1], t[2]) for t in totals.values() if t[0] == len(dp_batches) and t[1] > 0]
    if not rates:
        raise ValueError(f"no layout of {world_size} processes fits all of its first {SEARCH_BATCHES} batches; "
                         f"lower tokens_per_step or raise memory_budget_gib" + (f". {no_fit}" if no_fit else ""))
    top = max(rate for rate, _ in rates)
    best = min((o for rate, o in rates if rate >= top * (1 - 1e-9)), key=rank_key).layout
    table = "\n\n".join(format_search(s) for s in searches)
    return best, f"{table}\nchosen over the first batch(es) of each DP degree: {best.label}, shard {best.shard} " \
                 f"({top:,.0f} tokens/s planned)"


def _agree(payload, rank: int):
    """Rank 0's ``payload`` on every rank (a no-op in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return payload
    box = [payload if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolve_auto_layout(trainer, hf_config, world_size: int) -> None:
    """Set ``trainer.args``' degrees and shard from the layout search on its first training batches
    (rank 0's search, shared); ``ValueError`` on every rank when no layout can run or fits."""
    from infinipipe_hf.trainer.notices import global_rank

    rank = global_rank()
    payload = _search_on_rank0(trainer, hf_config, world_size) if rank == 0 else None
    payload = _agree(payload, rank)
    if "error" in payload:
        raise ValueError(payload["error"])
    args = trainer.args
    for name, value in payload.items():
        setattr(args, name, value)
    if args.sp_rounds and args.sp_degree == 1:
        args.sp_rounds = None  # rounds need SP ranks to split; the search planned this layout without them


def _search_on_rank0(trainer, hf_config, world_size: int) -> dict:
    """The chosen degrees, or ``{"error": message}``."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.runtime.engine.planning import memory_budget_bytes

    args = trainer.args
    try:
        if trainer.train_dataset is None:
            raise ValueError("it plans the first batches of train_dataset: pass a train_dataset, or set "
                             "pp_degree (python -m infinipipe_hf.plan --search-layout recommends one)")
        def batches_for(dp: int) -> list[list[int]]:
            return first_batch_lengths(trainer._global_loader(trainer.train_dataset, shuffle=True,
                                                              what="train_dataset", dp_degree=dp))

        gpn = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        budget = memory_budget_bytes(InfiniPipeConfig(**placeholder_kwargs(args)), args.device)
        layout, table = choose(batches_for, ModelSpec.from_hf_config(hf_config), args, world_size, gpn, budget)
    except Exception as exc:  # noqa: BLE001 - every rank must raise it, none may wait forever
        what = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
        return {"error": f"pp_degree='auto': {what}{exc}"}
    logger.warning("pp_degree='auto': layout search\n%s", table)
    return layout.degrees()


def placeholder_kwargs(args) -> dict:
    """``InfiniPipeConfig`` keywords of ``args`` with a one-GPU layout in place of "auto" (for the
    checks and settings that do not depend on the layout)."""
    from infinipipe_hf.trainer.pipeline_arguments import config_kwargs

    kw = config_kwargs(args)
    kw.update(pp_degree=1, dp_degree=None, sp_degree=1 if kw["sp_degree"] == AUTO else kw["sp_degree"],
              shard="none" if kw["shard"] == AUTO else kw["shard"])
    if kw["sp_degree"] == 1 and kw["sp_rounds"]:
        kw["sp_rounds"] = None
    if kw.get("state_offload") == "states" and kw["shard"] == "none":
        kw["state_offload"] = "optimizer"  # the placeholder is unsharded; the search keeps 'states' sharded
    return kw
