"""Before any data is read: does the longest sequence a batch may hold fit the job's layout?

A global batch holds at most ``tokens_per_step`` tokens, and the trainer cuts longer documents
(and those over the model's ``max_position_embeddings``, or SFT's ``max_length``) into pieces, so
no sequence is longer than the least of these (:func:`longest_possible`).  :func:`fit_advice`
asks the planner whether one such sequence fits the layout alone: the leanest plan first
(milliseconds), then ``plan_step``'s candidate search with the host tier (seconds).  When it does
not fit, the message gives the largest length this layout trains and what would fit the
sequence, each option checked by the same search: model states in host memory
(``state_offload``), a shard mode, more stages or a larger SP group (more GPUs), or host memory
when there is none; model states that leave no room at all get the planner's advice by cause
(:func:`~infinipipe_hf.planner.search.limits.states_advice`).  The trainer warns (the data may be
shorter than the bound); the engine's planner still refuses a batch that does not fit.
"""
from __future__ import annotations

import dataclasses

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims, sharding_over
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.layout_search.host_tier import offload_runs
from infinipipe_hf.planner.layout_search.longest import candidates_fit, fits_alone, largest_alone, largest_length
from infinipipe_hf.planner.search.api import PlanOptions
from infinipipe_hf.planner.search.limits import states_advice, states_per_gpu


def longest_possible(args, spec: ModelSpec) -> int | None:
    """The longest sequence a global batch of ``args`` may hold (None: no bound known)."""
    bounds = [getattr(args, "tokens_per_step", None), spec.max_position_embeddings, getattr(args, "max_length", None)]
    bounds = [int(b) for b in bounds if isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0]
    return min(bounds) if bounds else None


def plan_options(config: InfiniPipeConfig) -> PlanOptions:
    """The options the engine plans with (``runtime.engine.planning``), budgets apart."""
    settings = config.plan_settings()
    if config.sp_degree == 1:
        settings["sp_rounds"] = None  # one rank per stage: a larger SP group a remedy tries gets the default
    return PlanOptions(**settings)


class FitCheck:
    """One sequence of the model on layouts of a job, under its GPU and host budgets."""

    def __init__(self, spec: ModelSpec, config: InfiniPipeConfig, budget_bytes: float, host_bytes: float,
                 profile: HardwareProfile | None = None):
        self.spec, self.config, self.budget, self.host = spec, config, float(budget_bytes), float(host_bytes)
        self.profile = profile or (HardwareProfile.load(config.profile) if config.profile else default_profile())
        self.options = plan_options(config)

    def cost(self, dims: ParallelDims, host: float | None = None) -> CostModel:
        split = self.config.layer_split if dims.pp_degree == self.config.pp_degree else None
        return CostModel(self.spec, self.profile, dims, layers_per_stage=split, memory_budget_bytes=self.budget,
                         loss_chunk_tokens=self.config.loss_chunk_tokens,
                         host_budget_bytes=self.host if host is None else host)

    def fits(self, dims: ParallelDims, tokens: int, host: float | None = None) -> bool:
        cost = self.cost(dims, host)
        if states_per_gpu(cost) >= self.budget:
            return False
        return fits_alone(cost, tokens, self.options.num_slices) or candidates_fit([tokens], cost, self.options)

    def largest(self, dims: ParallelDims) -> int:
        """The longest single sequence ``dims`` trains (within 1/16)."""
        return largest_length(lambda n: self.fits(dims, n), largest_alone(self.cost(dims)))

    def remedies(self, dims: ParallelDims, tokens: int) -> list[str]:
        """What else fits one sequence of ``tokens``, each option planned."""
        out = []
        for text, other in self._options(dims):
            if offload_runs(other) and self._fits_quietly(other, tokens):
                out.append(text)
        if not self.host:
            out.append("host memory for the plan (host_memory_gib > 0: optimizer states, layer inputs and K/V "
                       "in host memory; now 0)")
        return out

    def _fits_quietly(self, dims: ParallelDims, tokens: int) -> bool:
        try:
            return self.fits(dims, tokens)
        except ValueError:  # a layout the model or the checks refuse
            return False

    def _options(self, dims: ParallelDims):
        swap = dataclasses.replace
        if self.host and not dims.state_offload.offloaded:
            yield "state_offload='optimizer' (AdamW states in host memory)", swap(dims, state_offload="optimizer")
        if self.host and dims.shard.sharded and not dims.state_offload.weights_on_host:
            yield "state_offload='states' (every model state in host memory)", swap(dims, state_offload="states")
        for over, degree in (("sp", dims.sp_degree), ("dp", dims.dp_degree)):
            if degree > 1 and over not in dims.shard.shard_dims:
                mode = sharding_over({*dims.shard.shard_dims, over})
                yield f"shard={mode.name!r} (model states sharded over {over})", swap(dims, shard=mode)
        if 2 * dims.pp_degree <= self.spec.num_layers:
            yield (f"pp_degree={2 * dims.pp_degree} ({2 * dims.world_size} GPUs)",
                   swap(dims, pp_degree=2 * dims.pp_degree))
        if 2 * dims.sp_degree <= min(dims.gpus_per_node, self.spec.num_attention_heads):
            yield (f"sp_degree={2 * dims.sp_degree} ({2 * dims.world_size} GPUs)",
                   swap(dims, sp_degree=2 * dims.sp_degree))


def fit_advice(check: FitCheck, dims: ParallelDims, tokens: int) -> str | None:
    """None when one sequence of ``tokens`` fits ``dims``; else why not and what would."""
    if check.fits(dims, tokens):
        return None
    cost = check.cost(dims)
    if states_per_gpu(cost) >= check.budget:
        return f"no sequence fits this layout: {states_advice(cost)}"
    largest = check.largest(dims)
    options = check.remedies(dims, tokens)
    fix = ("; it would fit with " + ", or ".join(options)) if options else (
        "; no single change tried fits it (state offload, sharding, twice the stages or SP ranks): split longer "
        "documents (tokens_per_step) or use more GPUs")
    return (f"a sequence of {tokens} tokens (the longest a batch may hold: tokens_per_step, the model's positions or "
            f"max_length) does not fit {dims} within {check.budget / 2**30:.3g} GiB per GPU and "
            f"{check.host / 2**30:.3g} GiB of host memory per GPU: the largest this layout trains is about {largest} "
            f"tokens{fix}")


def check_longest_fits(args, spec: ModelSpec, dims: ParallelDims, budget_bytes: float | None) -> str | None:
    """The trainer's preflight: the advice of :func:`fit_advice` for the longest sequence a batch of
    ``args`` may hold on ``dims`` (None when it fits or there is no device budget to check)."""
    tokens = longest_possible(args, spec)
    if budget_bytes is None or tokens is None:
        return None
    from infinipipe_hf.runtime.engine.planning import host_budget_bytes

    config = args.to_infinipipe_config()
    return fit_advice(FitCheck(spec, config, budget_bytes, host_budget_bytes(config, args.device)), dims, tokens)


def warn_if_too_long(args, spec: ModelSpec, dims: ParallelDims) -> None:
    """Warn (rank 0) when the longest sequence a batch may hold does not fit ``dims`` (module docstring)."""
    from infinipipe_hf.runtime.engine.planning import memory_budget_bytes
    from infinipipe_hf.trainer import notices

    if notices.global_rank() != 0:
        return
    advice = check_longest_fits(args, spec, dims, memory_budget_bytes(args.to_infinipipe_config(), args.device))
    if advice is not None:
        notices.warn(f"{advice}. The planner refuses a batch with such a sequence when it comes")
