"""``PipelineEngine``: the user-facing multi-process runtime.

Design: the engine owns one rank's view of the job: its ``ParallelLayout`` (the dp x pp x sp
``DeviceMesh`` and groups), its ``StageModule`` (a contiguous block of decoder layers of the HF
model, original parameter names), a ``StageRunner`` (single-process forward/backward per unit)
and a ``PipelineExecutor`` (the action loop with point-to-point transfers).  ``train_step`` is:
lengths -> plan (identical on every rank: ``PlanAgreement``) -> execute -> gradient collectives
(``GradientSync``) -> loss sum.  Gradients accumulate like ``loss.backward()``: gradients already
in ``.grad`` are stashed before the step and added back after the reductions, so they are never
all-reduced twice.

Sharding (``config.shard`` != ``"none"``): the stage's parameters, gradients and optimizer states
are sharded with FSDP2 (``StageSharding``) before anything reaches the device; parameters are then
``DTensor`` s, the step's gradients are reduced once after its last backward (inside
``GradientSync.sync``), and ``compute_dtype`` selects FSDP's mixed precision.

With ``sp_degree > 1`` the engine gives its runner a ``SequenceParallel`` (the stage's SP group):
each rank runs its token shard of every unit and attention runs head-sharded between two
all-to-alls; the per-step gradient all-reduce over the stage's DP x SP ranks then sums the SP
ranks' partial gradients.  The layout is refused up front when a rank would get no attention
head (``sp_degree`` above the model's head count).

Trade-offs: the planner is called synchronously (planning one step ahead in a background worker
is the trainer's job).  A planner can be injected (``planner=callable(lengths, engine) -> Plan |
PlanResult``, or ``train_step(batch, plan=...)``) so tests and baselines do not depend on the
default planner.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from infinipipe_hf.config import InfiniPipeConfig, divisors
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.runtime.parallel.comm import StageComm
from infinipipe_hf.runtime.engine.executor import PipelineExecutor
from infinipipe_hf.runtime.parallel.grad_sync import GradientSync
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
from infinipipe_hf.runtime.parallel.plan_sync import PlanAgreement
from infinipipe_hf.runtime.parallel.sequence_parallel import SequenceParallel
from infinipipe_hf.runtime.parallel.fsdp import StageSharding, check_shard_mode, fsdp2_api
from infinipipe_hf.runtime.engine.timeline import Timeline
from infinipipe_hf.runtime.stage.unit_tensors import check_batch


@dataclass
class StepOutput:
    loss: float
    """Mean token loss of the whole global batch; identical on every rank."""
    num_tokens: int
    num_label_tokens: int
    plan: Plan
    simulation: Any | None
    timeline: Timeline
    """This rank's actions; ``PipelineEngine.gather_timeline`` merges all ranks'."""
    step_time_s: float


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _tied(model) -> bool:
    # Same rule as build_stage, so every rank agrees on whether the tied-embedding groups exist.
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


class PipelineEngine:
    """One rank of an elastic pipeline over ``model``; see the module docstring."""

    def __init__(self, model, config: InfiniPipeConfig | None = None, *,
                 planner: Callable[[list[int], "PipelineEngine"], Any] | None = None,
                 device: torch.device | str | None = None,
                 compute_dtype: torch.dtype | None = None,
                 timeout_setting: str = "InfiniPipeConfig.p2p_timeout_s") -> None:
        """``compute_dtype`` (with ``shard`` != ``"none"``): FSDP2 mixed precision, i.e. gather
        parameters and compute in this dtype (bf16), reduce gradients in float32, keep the shards
        (master weights) in the model's dtype.  ``timeout_setting`` is the name timeout errors tell
        the user to raise (a wrapper whose users set the deadline under another name, like the
        trainer's ``ddp_timeout``, passes it)."""
        from infinipipe_hf.ir.partition import partition_layers
        from infinipipe_hf.runtime.stage.module import build_stage
        from infinipipe_hf.runtime.stage.runner import StageRunner

        self.config = config = config if config is not None else InfiniPipeConfig()
        dist = _dist()
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist else (1, 0)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if dist is None and (config.pp_degree > 1 or config.sp_degree > 1 or launched > 1):
            raise ValueError(f"torch.distributed is not initialised (pp_degree={config.pp_degree}, "
                             f"sp_degree={config.sp_degree}, WORLD_SIZE={launched}); call "
                             f"torch.distributed.init_process_group() before building the "
                             f"PipelineEngine (launch with torchrun)")
        if getattr(model, "config", None) is None:
            raise ValueError(f"{type(model).__name__} has no HF `config`; pass a transformers "
                             f"AutoModelForCausalLM model (Llama, Mistral, Qwen2, Qwen3)")
        # Model checks before any process group exists: every rank fails the same way, early.
        self.spec = ModelSpec.from_hf_config(model.config)
        if config.pp_degree > self.spec.num_layers:
            raise ValueError(f"pp_degree={config.pp_degree} is larger than the model's "
                             f"{self.spec.num_layers} decoder layers; use pp_degree <= "
                             f"{self.spec.num_layers}")
        self.planner = planner
        if config.sp_degree > self.spec.num_attention_heads:
            # Ulysses gives each SP rank whole attention heads (unevenly when they do not divide).
            ok = [d for d in divisors(world // config.pp_degree) if d <= self.spec.num_attention_heads] \
                if world % config.pp_degree == 0 else []
            raise ValueError(f"sp_degree={config.sp_degree} is larger than the model's "
                             f"{self.spec.num_attention_heads} attention heads: each sequence-parallel "
                             f"rank computes at least one head; use sp_degree <= "
                             f"{self.spec.num_attention_heads}"
                             + (f" (with pp_degree={config.pp_degree} on {world} processes: "
                                f"{', '.join(map(str, ok))})" if ok else ""))
        dp = config.resolve_dp_degree(world)
        if config.shard != "none":
            # Before any group exists, so every rank fails the same way, early.
            fsdp2_api(config.shard)
            check_shard_mode(config.shard, dp, config.sp_degree)
        elif compute_dtype is not None:
            raise ValueError(f"compute_dtype={compute_dtype} is FSDP2 mixed precision and needs "
                             f"shard != 'none'; without sharding cast the model (model.to(dtype))")
        self.device = torch.device(device) if device is not None else self._default_device()
        self.layout = ParallelLayout(world, rank, config.pp_degree, dp, sp_degree=config.sp_degree,
                                     tied_embeddings=_tied(model), timeout_s=config.p2p_timeout_s,
                                     timeout_setting=timeout_setting, device_type=self.device.type)
        ranges = partition_layers(self.spec.num_layers, config.pp_degree,
                                  layer_split=config.layer_split,
                                  last_stage_extra=self.spec.embedding_params / self.spec.layer_params)
        self.layers_per_stage = [len(r) for r in ranges]
        self.stage = build_stage(model, self.layout.stage_index, ranges[self.layout.stage_index])
        self.sharding: StageSharding | None = None
        if config.shard != "none":
            # Sharded on the host/meta device: only this rank's shards are put on the device.
            self.sharding = StageSharding(self.stage, self.layout, config.shard, self.device,
                                          compute_dtype=compute_dtype)
        else:
            self.stage.to(self.device)
        self.dtype = compute_dtype or next(
            (p.dtype for p in self.stage.parameters() if p.is_floating_point()), torch.float32)
        self.sequence_parallel = (SequenceParallel(self.layout, num_heads=self.spec.num_attention_heads,
                                                   num_kv_heads=self.spec.num_key_value_heads,
                                                   timeout_s=config.p2p_timeout_s)
                                  if config.sp_degree > 1 else None)
        self.runner = StageRunner(self.stage, loss_chunk_tokens=config.loss_chunk_tokens,
                                  attention_backend=config.attention_backend,
                                  label_smoothing=config.label_smoothing,
                                  sequence_parallel=self.sequence_parallel)
        comm = (StageComm(self.layout, timeout_s=config.p2p_timeout_s, device=self.device,
                          dtype=self.dtype) if config.pp_degree > 1 else None)
        self.executor = PipelineExecutor(self.runner, self.layout, comm)
        self.plan_agreement = PlanAgreement(self.layout, self.device, config.p2p_timeout_s)
        self.grad_sync = GradientSync(self.layout, self.device, config.p2p_timeout_s,
                                      trainable=self._trainable, tied=self._tied_params,
                                      sharding=self.sharding)
        self.last_plan: Plan | None = None
        self.step_count = 0
        self._profile = None  # loaded on first use of the default planner

    @staticmethod
    def _default_device() -> torch.device:
        if torch.cuda.is_available():
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
            return dev
        return torch.device("cpu")

    # --- parameters ----------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their original HF names (``DTensor`` s when sharded)."""
        return self.stage.named_parameters()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters() if p.requires_grad]

    def _tied_params(self) -> list[torch.nn.Parameter]:
        if not (self.layout.has_tied_pair and (self.layout.is_first_stage or self.layout.is_last_stage)):
            return []
        params = dict(self.stage.named_parameters(remove_duplicate=False))
        return [params[n] for n in self.stage.tied_parameter_names if params[n].requires_grad]

    # --- planning ------------------------------------------------------------------------
    def _memory_budget_bytes(self) -> float | None:
        if self.config.memory_budget_gib is not None:
            return self.config.memory_budget_gib * 2**30
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            return total * (1.0 - self.config.memory_margin) - self.config.memory_reserve_gib * 2**30
        return None

    def _default_plan(self, lengths: list[int]):
        from infinipipe_hf.planner.search.api import plan_step  # lazy: the engine imports without the planner
        from infinipipe_hf.planner.cost.profile import HardwareProfile

        c = self.config
        if self._profile is None:
            from infinipipe_hf.planner.cost.profile import default_profile
            from infinipipe_hf.runtime.attention.hf import sdpa_backend

            profile = HardwareProfile.load(c.profile) if c.profile is not None else default_profile()
            if self.runner.backend is sdpa_backend and not profile.attention_mask_bytes_per_element:
                # The SDPA fallback keeps a dense mask (in the compute dtype) per slice with
                # context; plan with it so the memory model matches what this rank really holds.
                profile = dataclasses.replace(profile, attention_mask_bytes_per_element=float(
                    torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else 4))
            self._profile = profile
        return plan_step(lengths, self.spec, pp_degree=c.pp_degree, dp_degree=self.layout.dp_degree,
                         schedule=c.schedule, memory_budget_bytes=self._memory_budget_bytes(),
                         profile=self._profile, layers_per_stage=self.layers_per_stage,
                         max_tokens_per_unit=c.max_tokens_per_unit, num_slices=c.num_slices,
                         checkpointing=c.checkpointing, loss_chunk_tokens=c.loss_chunk_tokens,
                         sp_degree=c.sp_degree, shard=c.shard,
                         checkpoint_levels=self._checkpoint_levels())

    def _checkpoint_levels(self) -> tuple[str, ...]:
        """The configured levels this stage can run (the others dropped with a warning)."""
        from infinipipe_hf.runtime.recompute.layers import runnable_levels

        levels = tuple(self.config.checkpoint_levels)
        kept, why = runnable_levels(levels, [lay for _, lay in self.stage.decoder_layers()], self.device, self.dtype)
        if why is not None:
            warnings.warn(f"checkpoint_levels={levels}: planning with {kept or 'whole layers only'}: {why}. "
                          f"Set InfiniPipeConfig(checkpoint_levels={kept!r}) to silence this", stacklevel=3)
            self.config.checkpoint_levels = kept
        return kept

    def plan_locally(self, lengths: list[int]) -> tuple[Plan, Any]:
        """This rank's own plan of ``lengths`` and its simulation, with no communication: safe to
        call from one rank only (reporting, drawing), unlike the collective :meth:`make_plan`."""
        result = self.planner(lengths, self) if self.planner is not None else self._default_plan(lengths)
        if isinstance(result, Plan):
            return result, None
        if not getattr(result, "feasible", False) or result.plan is None:
            raise ValueError(f"no feasible plan for a batch of {len(lengths)} sequences "
                             f"({sum(lengths)} tokens, longest {max(lengths)}): "
                             f"{getattr(result, 'error', None)}; raise memory_budget_gib, pp_degree "
                             f"or lower the batch's token budget")
        return result.plan, getattr(result, "simulation", None)

    def make_plan(self, lengths: list[int]) -> tuple[Plan, Any]:
        """Plan a step (same result on every rank); returns ``(plan, simulation or None)``.

        Collective when the world has more than one rank: every rank must call it."""
        if self.layout.world_size == 1:
            return self.plan_locally(lengths)
        step = self.step_count
        if self.config.seed_plan_on_rank0:
            return self.plan_agreement.from_rank0(lambda: self.plan_locally(lengths), step=step)
        planned = self.plan_locally(lengths)
        if self.plan_agreement.all_agree(planned[0], step=step):
            return planned
        # A planner with a wall-clock limit (the MILP solver) can differ between ranks; running
        # different plans would mismatch shapes, so everyone takes rank 0's.
        warnings.warn(f"step {step}: ranks planned differently (is the planner "
                      f"deterministic? a solver time limit can make it not); using rank 0's plan. "
                      f"Set InfiniPipeConfig(seed_plan_on_rank0=True) to always do so", stacklevel=3)
        return self.plan_agreement.from_rank0(lambda: planned, step=step)

    def _check_plan(self, plan: Plan, lengths: list[int]) -> None:
        lay = self.layout
        if plan.pp_degree != lay.pp_degree or plan.dp_degree != lay.dp_degree:
            raise ValueError(f"plan is for pp={plan.pp_degree}, dp={plan.dp_degree} but the engine "
                             f"runs pp={lay.pp_degree}, dp={lay.dp_degree}; plan with the engine's degrees")
        if list(plan.sequences) != list(lengths):
            raise ValueError(f"plan covers sequence lengths {list(plan.sequences)[:8]}... but the batch "
                             f"has {lengths[:8]}...; plan the same batch that you run")
        if plan.layers_per_stage and list(plan.layers_per_stage) != self.layers_per_stage:
            raise ValueError(f"plan assumes layers per stage {plan.layers_per_stage}, the engine has "
                             f"{self.layers_per_stage}; pass layers_per_stage=engine.layers_per_stage")

    # --- steps ---------------------------------------------------------------------------
    def _prepare(self, batch, plan: Plan | None):
        from infinipipe_hf.runtime.stage.unit_tensors import label_token_count

        batch = check_batch(batch)
        if self.sequence_parallel is not None:
            self.sequence_parallel.step = self.step_count  # named in all-to-all timeout errors
        lengths = [int(i["input_ids"].numel()) if isinstance(i["input_ids"], torch.Tensor)
                   else len(i["input_ids"]) for i in batch]
        n_labels = label_token_count(batch)
        if n_labels < 1:
            raise ValueError(f"the batch of {len(batch)} sequences has no label tokens (all labels "
                             f"are -100 or every sequence has one token); the mean loss is undefined")
        sim = None
        if plan is None:
            plan, sim = self.make_plan(lengths)
        elif self.layout.world_size > 1 and not self.plan_agreement.all_agree(plan, step=self.step_count):
            raise ValueError(f"step {self.step_count}: the plan passed to this rank differs from "
                             f"other ranks' plans; pass the same plan on every rank")
        self._check_plan(plan, lengths)
        return batch, lengths, n_labels, plan, sim

    def train_step(self, batch, *, plan: Plan | None = None,
                   num_label_tokens: int | None = None) -> StepOutput:
        """Forward + backward of the global ``batch``; gradients accumulate into ``.grad``.

        The loss is the token sum divided by ``num_label_tokens`` (default: the batch's own label
        count).  Passing the label count of several batches makes gradient accumulation over them
        the exact gradient of their joint mean, as HF's ``num_items_in_batch`` does, instead of a
        rescaled one (equal in exact arithmetic, ~1e-7 apart in float32-normed models).
        """
        t0 = time.perf_counter()
        self.step_count += 1
        batch, lengths, n_labels, plan, sim = self._prepare(batch, plan)
        if num_label_tokens is not None and num_label_tokens < n_labels:
            raise ValueError(f"num_label_tokens={num_label_tokens} is below this batch's own "
                             f"{n_labels} label tokens; pass the count over every accumulated batch")
        normaliser = n_labels if num_label_tokens is None else int(num_label_tokens)
        self.last_plan = plan
        stash = {}
        for p in self._trainable():
            if p.grad is not None:
                stash[p] = p.grad
                p.grad = None
        self.stage.train()
        try:
            if self.sharding is not None:
                self.sharding.begin_step()
            self.runner.begin_step(plan, batch, normaliser)
            result = self.executor.run(plan, step=self.step_count, train=True)
            self.runner.end_step()
            self.grad_sync.sync(self.step_count)
        except BaseException:
            if self.sharding is not None:
                self.sharding.abort_step()  # reshard first: the sharded parameters hold the stash
            # Keep what was accumulated before this step; drop the failed step's partial grads.
            for p in self._trainable():
                p.grad = stash.get(p)
            raise
        for p, old in stash.items():
            p.grad = old if p.grad is None else old.add_(p.grad)
        loss = self.grad_sync.global_sum(result.loss_part, "loss sum", self.step_count)
        return StepOutput(loss=loss, num_tokens=sum(lengths), num_label_tokens=n_labels, plan=plan,
                          simulation=sim, timeline=result.timeline,
                          step_time_s=time.perf_counter() - t0)

    @torch.no_grad()
    def eval_step(self, batch, *, plan: Plan | None = None) -> float:
        """Mean token loss of ``batch`` through the pipeline, forwards only; same on every rank."""
        self.step_count += 1
        batch, _, n_labels, plan, _ = self._prepare(batch, plan)
        was_training = self.stage.training
        self.stage.eval()
        try:
            if self.sharding is not None:
                self.sharding.begin_forward_only()
            self.runner.begin_step(plan, batch, n_labels)
            result = self.executor.run(plan, step=self.step_count, train=False)
            self.runner.end_step()
        finally:
            if self.sharding is not None:
                self.sharding.finish_forward_only()
            self.stage.train(was_training)
        return self.grad_sync.global_sum(result.loss_part, "eval loss sum", self.step_count)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm (all stages, tied weight once) is <= max_norm."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        total = self.grad_sync.global_norm(self.step_count)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for p in self._trainable():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total

    def gather_timeline(self, timeline: Timeline) -> Timeline:
        """Merge every rank's timeline of a step (collective: call on all ranks)."""
        dist = _dist()
        if self.layout.world_size == 1:
            return timeline
        parts: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(parts, timeline.to_dict())
        return Timeline.merge([Timeline.from_dict(p) for p in parts])
