"""What the layout search returns: one outcome per layout, the alternatives, the recommendation.

:class:`LayoutSearch.to_dict` is the ``--search-layout --json`` object of the planner CLI
(docs/contracts.md): ``{"recommended": {"pp_degree", "sp_degree", "dp_degree", "shard",
"tokens_per_s", ...}, "layouts": [...], "alternatives": [...], ...}``; :func:`~.table.format_search`
is its table (the CLI without ``--json``, and the trainer's log with ``pp_degree="auto"``).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.layout_search.host_tier import host_peak_bytes
from infinipipe_hf.planner.search.api import PlanOptions
from infinipipe_hf.planner.search.result import PlanResult


def gib(nbytes: float) -> str:
    """Bytes as GiB with three significant digits (budgets range from MiB in tests to 141 GiB)."""
    return f"{nbytes / 2**30:.3g}"


def training_arguments(dims: ParallelDims, settings: Mapping[str, Any] | None = None) -> str:
    """The ``EPPTrainingArguments`` fields that select ``dims`` (and ``settings``: the other
    fields that change the plan, :func:`recipe_settings`), as Python."""
    return ", ".join(f"{k}={v!r}" for k, v in {**dims.degrees(), **(settings or {})}.items())


def recipe_flags(dims: ParallelDims, settings: Mapping[str, Any] | None = None) -> str:
    """The same fields on a recipe's command line (``recipes/train.py``, ``HfArgumentParser``).
    An empty list has no command-line form and is left out (:func:`flagless`)."""
    return " ".join(f"--{k} {_flag_value(v)}" for k, v in {**dims.degrees(), **(settings or {})}.items()
                    if not _empty_list(v))


def plan_flags(dims: ParallelDims) -> str:
    """The planner CLI's flags that plan ``dims`` alone."""
    return f"--pp {dims.pp_degree} --sp {dims.sp_degree} --dp {dims.dp_degree} --shard {dims.shard.name}"


def _empty_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not value


def _flag_value(value: Any) -> str:
    """A value as ``HfArgumentParser`` reads it back: lists space-separated, floats exactly."""
    if isinstance(value, (list, tuple)):
        return " ".join(shlex.quote(str(v)) for v in value)
    return repr(value) if isinstance(value, float) else shlex.quote(str(value))


def flagless(settings: Mapping[str, Any]) -> list[str]:
    """The settings the recipe flags cannot carry (empty lists), as Python to set instead."""
    return [f"{k}=[]" for k, v in settings.items() if _empty_list(v)]


def recipe_settings(lengths: Sequence[int], memory_budget_bytes: float, plan_options: Mapping[str, Any]) -> dict:
    """The ``EPPTrainingArguments`` fields besides the degrees that change a layout's plan:
    ``tokens_per_step`` (the batch's tokens), ``memory_budget_gib`` (the exact budget planned to, so
    the trainer plans to the same bytes whatever its device reports) and every plan option that
    differs from ``plan_step``'s default (the trainer's defaults are the same)."""
    defaults = {f.name: f.default for f in fields(PlanOptions)}
    out: dict[str, Any] = {"tokens_per_step": int(sum(lengths)), "memory_budget_gib": memory_budget_bytes / 2**30}
    for name, value in plan_options.items():
        default = defaults.get(name)
        same = tuple(value) == tuple(default) if isinstance(value, (list, tuple)) and default is not None \
            else value == default
        if not same:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


@dataclass
class LayoutOutcome:
    """One layout's EPP plan, or why it was ruled out before planning."""

    layout: ParallelDims
    result: PlanResult | None
    """``plan_step``'s result; None when ruled out before planning."""
    ruled_out: str | None
    """Why the layout cannot fit, found before planning (model states, the longest sequence)."""
    search_time_s: float
    """Seconds this layout took (checks and planning)."""
    priced_as: str | None = None
    """The shard mode whose plan this layout shares (the cost model prices both alike)."""
    largest_trainable: int | None = None
    """Longest single sequence this layout trains (computed when no layout fits the batch)."""
    sp_rounds: bool = False
    """The plan runs elastic SP rounds (units on SP sub-groups)."""
    unfed_replicas: bool = False
    """Ruled out because the batch has fewer sequences than the layout's DP replicas."""
    states_bytes: float | None = None
    """Model states per GPU on the fullest stage (computed when no layout fits the batch)."""
    largest_length: int | None = None
    """Longest single sequence ``plan_step`` fits on this layout with the search's host tier
    (found for a one-sequence batch)."""
    largest_length_without_offload: int | None = None
    """The same without the host tier: no state offload, no host memory."""

    @property
    def feasible(self) -> bool:
        return self.result is not None and self.result.feasible

    @property
    def tokens_per_s(self) -> float:
        return self.result.simulation.tokens_per_s if self.feasible else 0.0

    @property
    def peak_memory_bytes(self) -> float:
        sim = self.result.simulation if self.result is not None else None
        return max(sim.peak_memory_bytes) if sim is not None and sim.peak_memory_bytes else 0.0

    @property
    def host_peak_memory_bytes(self) -> float:
        return host_peak_bytes(self.result)

    @property
    def error(self) -> str | None:
        if self.ruled_out:
            return self.ruled_out
        return None if self.result is None else self.result.error

    def priced_as_layout(self, layout: ParallelDims) -> LayoutOutcome:
        """This outcome for ``layout``, whose shard mode the cost model prices the same."""
        return replace(self, layout=layout, priced_as=self.layout.shard.name, search_time_s=0.0)

    def to_dict(self) -> dict:
        d = {**self.layout.degrees(), "state_offload": self.layout.state_offload.name, "feasible": self.feasible,
             "tokens_per_s": self.tokens_per_s}
        sim = self.result.simulation if self.result is not None else None
        if sim is not None:
            d.update(step_time_s=sim.step_time_s, peak_memory_bytes=list(sim.peak_memory_bytes),
                     host_peak_memory_bytes=self.host_peak_memory_bytes,
                     bubble_fraction=sim.bubble_fraction, recompute_fraction=sim.recompute_fraction,
                     num_units=len(self.result.plan.units) if self.result.plan is not None else 0,
                     num_pipelines=self.result.plan.num_pipelines if self.result.plan is not None else 0)
        d["planning_time_s"] = self.search_time_s
        d["sp_rounds"] = self.sp_rounds
        if self.layout.shard.sharded and getattr(self.result, "plan", None) is not None:
            d["grad_reduce"] = self.result.plan.grad_reduce  # when its sharded stages reduce gradients
        if self.priced_as:
            d["priced_as"] = self.priced_as
        if self.largest_trainable is not None:
            d["largest_trainable_length"] = self.largest_trainable
        if self.states_bytes is not None:
            d["model_states_bytes"] = self.states_bytes
        if self.largest_length is not None:
            d.update(largest_length=self.largest_length,
                     largest_length_without_offload=self.largest_length_without_offload)
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class LayoutSearch:
    """Every layout of one search (ranked: feasible fastest first), the alternatives, the pick."""

    world_size: int
    gpus_per_node: int
    memory_budget_bytes: float
    layouts: list[LayoutOutcome]
    alternatives: dict[str, PlanResult]
    recommended: LayoutOutcome | None
    tie_break: str
    search_time_s: float
    """Seconds of the whole search (every layout, the alternatives, the pick)."""
    extra: dict = field(default_factory=dict)
    """More keys for ``to_dict`` (the CLI adds the command that replans the pick)."""
    without_sp_rounds: PlanResult | None = None
    """The pick planned without elastic SP rounds, when its plan uses them."""
    settings: dict = field(default_factory=dict)
    """``EPPTrainingArguments`` fields besides the degrees that reproduce the plans
    (:func:`recipe_settings`; the CLI adds ``profile``)."""
    host_budget_bytes: float = 0.0
    """Host memory per GPU the plans may use (0: no host tier)."""

    def recommended_settings(self) -> dict:
        """``settings`` for the pick: ``sp_rounds=True`` is dropped at sp 1, as its plan ran without."""
        out = dict(self.settings)
        if out.get("sp_rounds") and self.recommended is not None and self.recommended.layout.sp_degree == 1:
            del out["sp_rounds"]
        return out

    def recommended_dict(self) -> dict | None:
        best = self.recommended
        if best is None:
            return None
        lay = best.layout
        d = best.to_dict()
        d.pop("planning_time_s")
        settings = self.recommended_settings()
        d.update(label=lay.label, training_arguments={**lay.degrees(), **settings},
                 recipe_flags=recipe_flags(lay, settings),
                 over_alternatives={n: best.tokens_per_s / r.simulation.tokens_per_s
                                    for n, r in self.alternatives.items() if r.feasible and r.simulation.tokens_per_s},
                 plan=best.result.summary())
        # Behind beyond float noise: the same plan priced twice agrees to the tie-break's 1e-9.
        d["behind_alternatives"] = {n: r for n, r in d["over_alternatives"].items() if r < 1.0 - 1e-9}
        whole = self.without_sp_rounds
        if whole is not None:
            d["without_sp_rounds"] = {k: v for k, v in whole.summary().items()
                                      if k in ("feasible", "tokens_per_s", "step_time_s", "peak_memory_bytes",
                                               "bubble_fraction", "recompute_fraction", "error")}
        return d

    def to_dict(self) -> dict:
        return {"recommended": self.recommended_dict(), "layouts": [o.to_dict() for o in self.layouts],
                "alternatives": [r.summary() for r in self.alternatives.values()],
                "world_size": self.world_size, "gpus_per_node": self.gpus_per_node,
                "memory_budget_bytes": self.memory_budget_bytes, "host_memory_budget_bytes": self.host_budget_bytes,
                "tie_break": self.tie_break,
                "num_layouts": len(self.layouts),
                "num_planned": sum(o.result is not None and o.priced_as is None for o in self.layouts),
                "search_time_s": self.search_time_s, **self.extra}


def layout_name(dims: ParallelDims) -> str:
    """A layout in messages: degrees, shard mode and, when any, state offload."""
    offload = f", state offload {dims.state_offload}" if dims.state_offload.offloaded else ""
    return f"{dims.label} shard {dims.shard}{offload}"


class NoLayoutFits(ValueError):
    """No layout fits the memory budget.  The message says why, by cause, with the numbers: the model
    states on every layout (with ``states_remedies``: what would fit them), the longest sequence, or
    the whole batch; then each layout's largest trainable sequence."""

    def __init__(self, search: LayoutSearch, lengths: Sequence[int], states_remedies: str = ""):
        self.search = search
        ranked = sorted(search.layouts, key=lambda o: -(o.largest_trainable or 0))  # stable: search order on ties
        per = "; ".join(f"{layout_name(o.layout)}: {o.largest_trainable}" for o in ranked)
        gpus = f"{search.world_size} GPU{'s' if search.world_size != 1 else ''}"
        super().__init__(f"no layout of {gpus} fits {gib(search.memory_budget_bytes)} GiB per GPU "
                         f"for this batch; {no_fit_cause(search, lengths, states_remedies)}. Largest trainable "
                         f"sequence per layout (tokens, longest first): {per}")


def no_fit_cause(search: LayoutSearch, lengths: Sequence[int], states_remedies: str = "") -> str:
    """Why no layout fits: model states everywhere, one sequence too long, or the batch's activations."""
    # Layouts ruled out for want of sequences per replica say nothing about memory.
    longest = max(lengths)
    outcomes = [o for o in search.layouts if not o.unfed_replicas] or search.layouts
    best = max(outcomes, key=lambda o: o.largest_trainable or 0)
    if not best.largest_trainable:
        least = min(outcomes, key=lambda o: o.states_bytes if o.states_bytes is not None else float("inf"))
        states = f" (the least: {gib(least.states_bytes)} GiB per GPU, {layout_name(least.layout)})" \
            if least.states_bytes is not None else ""
        return (f"the model states (weights, gradients, optimizer states) leave no room for any sequence on any "
                f"layout{states}" + (f"; {states_remedies}" if states_remedies else ""))
    fits_alone = [o for o in outcomes if (o.largest_trainable or 0) >= longest]
    # Without a one-sequence search the figure is the leanest plan's, which keeps everything on the device.
    device_only = bool(search.host_budget_bytes) and best.largest_length is None
    if not fits_alone:
        where = (" with no activations or K/V in host memory (every layer checkpointed: the host tier may "
                 "reach further; search that sequence alone for its planned limit)") if device_only else ""
        return (f"the longest sequence has {longest} tokens but the largest any layout trains{where} is "
                f"{best.largest_trainable} ({layout_name(best.layout)}): split or truncate "
                f"longer documents (the trainer cuts documents longer than tokens_per_step into pieces), use more "
                f"GPUs (more stages, a larger sp group) or a larger memory budget"
                + ("" if search.host_budget_bytes else ", or give the plan host memory (--host-memory-gib / "
                   "host_memory_gib: layer inputs, K/V and model states in host memory)"))
    return (f"the longest sequence ({longest} tokens) fits alone on {len(fits_alone)} of them but the whole batch "
            f"({len(lengths)} sequences, {sum(lengths)} tokens) does not: its activations do not fit beside the "
            f"model states; use fewer tokens per step (tokens_per_step), more GPUs or a larger memory budget")


def unfed_replicas_reason(num_sequences: int, layout: ParallelDims) -> str:
    """Why ``layout`` is ruled out for a batch with fewer sequences than its DP replicas."""
    dp_degree = layout.dp_degree
    return (f"{num_sequences} sequence{'s' if num_sequences != 1 else ''} for {dp_degree} DP replicas: a replica "
            f"would idle (the trainer gives each its own; search a batch of >= {dp_degree} sequences)")
