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
head (``sp_degree`` above the model's head count).  A plan with SP sub-groups and rounds
(``ir.rounds``) runs each unit on its sub-group only: a rank runs the units of its sub-groups, a
sub-group of one with no all-to-all, and the same all-reduce sums the ranks' gradients
(the plan validator and ``rounds.py`` check such a plan first).

Host memory (``runtime/offload``): the stage's ``HostTier`` (``engine.host_tier``) holds the inputs
of the plan's ``offload`` layers between forward and backward, the KV store of a stage in the
plan's ``offload_kv``, and, under ``state_offload='optimizer'``, the ``HostOptimizer`` states.

Trade-offs: the planner is called synchronously (planning one step ahead in a background worker
is the trainer's job).  A planner can be injected (``planning.py``), or a plan passed to
``train_step(batch, plan=...)``.  Construction and its checks live in ``build.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.engine import planning
from infinipipe_hf.runtime.engine.build import (
    build_dims,
    build_sequence_parallel,
    build_stage,
    check_inputs,
    default_device,
    dist_or_none,
    tied_embeddings,
)
from infinipipe_hf.runtime.engine.executor import PipelineExecutor
from infinipipe_hf.runtime.engine.sp_rounds import check_runnable
from infinipipe_hf.runtime.engine.timeline import Timeline
from infinipipe_hf.runtime.parallel.comm import StageComm
from infinipipe_hf.runtime.parallel.fsdp import check_grad_reduce_runnable
from infinipipe_hf.runtime.parallel.grad_sync import GradientSync
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
from infinipipe_hf.runtime.parallel.plan_sync import PlanAgreement
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
    nonfinite_units: tuple[int, ...] = ()
    """Units whose token losses on this rank (a last stage) were NaN or infinite."""


class PipelineEngine:
    """One rank of an elastic pipeline over ``model``; see the module docstring."""

    def __init__(self, model, config: InfiniPipeConfig | None = None, *,
                 planner: Callable[[list[int], "PipelineEngine"], Any] | None = None,
                 device: torch.device | str | None = None,
                 compute_dtype: torch.dtype | None = None,
                 timeout_setting: str = "InfiniPipeConfig.p2p_timeout_s",
                 dims: ParallelDims | None = None) -> None:
        """``compute_dtype`` (with ``shard`` != ``"none"``): FSDP2 mixed precision, i.e. gather
        parameters and compute in this dtype (bf16), reduce gradients in float32, keep the shards
        (master weights) in the model's dtype.  ``timeout_setting`` is the name timeout errors tell
        the user to raise (a wrapper whose users set the deadline under another name, like the
        trainer's ``ddp_timeout``, passes it).  ``dims``: the job's layout when the caller has built
        and checked it already (the trainer does, before tokenizing); otherwise built here."""
        from infinipipe_hf.runtime.stage.runner import StageRunner

        self.config = config = config if config is not None else InfiniPipeConfig()
        dist = dist_or_none()
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist else (1, 0)
        self.spec = check_inputs(model, config, dist)
        self.planner = planner
        if dims is None:
            dims = build_dims(config, self.spec, world, compute_dtype)
        elif dims.world_size != world:
            raise ValueError(f"the layout passed ({dims.label}) has {dims.world_size} ranks but the job has {world}")
        self.device = torch.device(device) if device is not None else default_device()
        self.layout = ParallelLayout(dims, rank, tied_embeddings=tied_embeddings(model), timeout_s=config.p2p_timeout_s,
                                     timeout_setting=timeout_setting, device_type=self.device.type,
                                     kv_heads=self.spec.num_key_value_heads)
        self.layers_per_stage, self.stage, self.sharding = build_stage(
            model, config, self.spec, self.layout, self.device, compute_dtype)
        self.dtype = compute_dtype or next(
            (p.dtype for p in self.stage.parameters() if p.is_floating_point()), torch.float32)
        self.sequence_parallel = build_sequence_parallel(config, self.spec, self.layout)
        self.runner = StageRunner(self.stage, loss_chunk_tokens=config.loss_chunk_tokens,
                                  attention_backend=config.attention_backend,
                                  attention_table=planning.attention_table(config),
                                  label_smoothing=config.label_smoothing,
                                  sequence_parallel=self.sequence_parallel)
        comm = (StageComm(self.layout, timeout_s=config.p2p_timeout_s, device=self.device,
                          dtype=self.dtype) if dims.pp_degree > 1 else None)
        self.host_tier = self.runner.kv_store.host_tier
        """This stage's host memory: offloaded activations and K/V, host optimizer states."""
        self.executor = PipelineExecutor(self.runner, self.layout, comm, host_tier=self.host_tier)
        self.plan_agreement = PlanAgreement(self.layout, self.device, config.p2p_timeout_s)
        self.grad_sync = GradientSync(self.layout, self.device, config.p2p_timeout_s,
                                      trainable=self._trainable, tied=self._tied_params,
                                      sharding=self.sharding)
        self.last_plan: Plan | None = None
        self.step_count = 0
        self.default_planner = planning.DefaultPlanner()  # used when no planner is injected

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
    def plan_locally(self, lengths: list[int]) -> tuple[Plan, Any]:
        """This rank's own plan of ``lengths`` and its simulation, with no communication: safe to
        call from one rank only (reporting, drawing), unlike the collective :meth:`make_plan`."""
        return planning.plan_locally(self, lengths)

    def make_plan(self, lengths: list[int]) -> tuple[Plan, Any]:
        """Plan a step (same result on every rank); returns ``(plan, simulation or None)``.

        Collective when the world has more than one rank: every rank must call it."""
        return planning.make_plan(self, lengths)

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
            planning.check_plan(self, plan, lengths)
        else:
            planning.check_plan(self, plan, lengths)  # a given plan is refused before any communication
            if self.layout.world_size > 1 and not self.plan_agreement.all_agree(plan, step=self.step_count):
                raise ValueError(f"step {self.step_count}: the plan passed to this rank differs from "
                                 f"other ranks' plans; pass the same plan on every rank")
        check_runnable(plan, self.layout.dims)
        check_grad_reduce_runnable(plan.grad_reduce, self.layout.dims)
        return batch, lengths, n_labels, plan, sim

    def _begin_step(self, plan: Plan, batch, label_tokens: int) -> None:
        self.runner.begin_step(plan, batch, label_tokens)
        # K/V offload: the plan's ``offload_kv`` lists the stages whose KV store lives on the host.
        self.runner.kv_store.offload = self.layout.stage_index in plan.offload_kv

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
                self.sharding.begin_step(plan.grad_reduce)
            self._begin_step(plan, batch, normaliser)
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
                          step_time_s=time.perf_counter() - t0, nonfinite_units=result.nonfinite_units)

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
            self._begin_step(plan, batch, n_labels)
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
        dist = dist_or_none()
        if self.layout.world_size == 1:
            return timeline
        parts: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(parts, timeline.to_dict())
        return Timeline.merge([Timeline.from_dict(p) for p in parts])
