"""``StageSharding``: a pipeline stage's model states sharded with torch's FSDP2 (``fully_shard``).

Design.  Every rank of a stage holds only its shard of the stage's parameters, gradients and
optimizer states (ZeRO-3 at rest); the parameters are ``DTensor`` s.  The shard group is the
sub-mesh of the layout's ``DeviceMesh`` its ``ShardMode`` names (``layout.SHARD_TABLE``):

- ``shard="sp"``: the stage's SP ranks (``mesh["sp"]``), as InfiniPipe shards inside a node;
- ``shard="dp"``: the stage's DP replicas (``mesh["dp"]``);
- ``shard="sp+dp"``: both (``mesh["dp", "sp"]`` flattened);
- ``shard="hybrid"``: FSDP2's HSDP on the 2-D ``mesh["dp", "sp"]`` (replicate over DP, shard
  over SP: reduce-scatter inside the node, all-reduce across).

What FSDP does not reduce (the SP ranks' partial gradients under ``"dp"``, the DP replicas' under
``"sp"``) is summed over local shards by ``GradientSync`` over ``extra_group``.

Wrapping: ``fully_shard`` on each decoder layer, the embeddings, the final norm and the LM head
(one group with the embeddings when a tied head sits on the same stage), then on the stage's HF
model as root.  The root holds no parameters and never runs forward (the runner drives the
pieces); it is initialised explicitly so all groups share FSDP's communication state.
Mixed precision: with ``compute_dtype`` (bf16) FSDP all-gathers parameters in it and reduces
gradients in float32; the shards (master weights) keep the model's dtype.

Loading: parameters go to the meta device before ``fully_shard``, ``to_empty`` then allocates
only each rank's shard on the device and the shard is copied from the full host tensor (which
transformers memory-maps from safetensors).  A whole unsharded stage never reaches the device.

When gradients are reduced: as the plan says (``Plan.grad_reduce``, ``ir.grad_reduce``).
``step``: FSDP's gradient sync is off while the step's units run; unsharded gradients accumulate
over every unit's backward; after the last one ``reduce_gradients`` reduce-scatters them once (as
``torch.distributed.pipelining`` does for FSDP stages).  ``unit``: sync is on, so every module's
backward reduce-scatters its gradient into the sharded ``.grad`` and no unsharded gradient
outlives its module's backward (ZeRO-3's memory).  The LM head is the exception: the chunked loss
runs it once per chunk and SP ranks' chunk counts differ, so its reduction is chained to the final
norm's, which runs once per unit.  Gradients are summed, not averaged: every rank's loss is
already divided by the global label count.

When parameters are all-gathered.  FSDP all-gathers are collectives over the shard group, so
every rank of the group must unshard the same modules in the same order.  SP ranks of a stage run
the same action list, so under ``"sp"``/``"hybrid"`` parameters are gathered per unit (ZeRO-3:
resharded after each forward, re-gathered for its backward).  DP replicas run *different* unit
lists (elastic units are dealt to replicas by cost), so when the shard group spans replicas
(``"dp"``, ``"sp+dp"``) every module is gathered once when the step starts and resharded after
the reduction.  Trade-off: during a step the stage then holds full parameters (and, reducing
once per step, full gradients in every mode); between steps everything is sharded.
The final norm and LM head stay gathered from their first use to the end of the step in every
mode, so a unit's chunked loss does not all-gather the head once per chunk.
"""
from __future__ import annotations

import torch
from torch import nn

from infinipipe_hf.ir.grad_reduce import check_grad_reduce, unit_reduce_problem
from infinipipe_hf.layout import SHARD_TABLE, ShardMode
from infinipipe_hf.runtime.parallel.fsdp_api import copy_full_, fsdp2_api, is_dtensor
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout


class StageSharding:
    """FSDP2 wrapping of one stage and its once-per-step gradient reduction (module docstring)."""

    def __init__(self, stage, layout: ParallelLayout, device: torch.device, *,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.mode = layout.dims.shard
        """The layout's shard mode (checked runnable when the layout was built); unsharded stages
        with ``state_offload='states'`` run FSDP2 over their rank alone (``alone_mesh``)."""
        fully_shard, MixedPrecisionPolicy, self._fsdp_module_type = fsdp2_api(
            f"shard={self.mode.name!r}" if self.mode.sharded else f"state_offload={layout.dims.state_offload.name!r}")
        self.layout, self.device = layout, device
        if not self.mode.sharded:
            self.mode, self.mesh = SHARD_TABLE["sp"], alone_mesh(layout, device)
        elif layout.mesh is None:
            raise ValueError(f"shard={self.mode.name!r} needs the layout's DeviceMesh (a world of more than one "
                             f"rank with process groups)")
        else:
            self.mesh = self._shard_mesh(layout, self.mode)
        self.extra_group, self.extra_ranks = self._extra_group(layout, self.mode)
        self.gather_per_step = self.mode.per_step_gather
        """Gather every module once per step (shard group spans DP replicas, whose unit lists
        differ) instead of per unit.  Tests may set it to ``False`` with plans whose replicas
        run identical action sequences, to exercise the per-unit path on DP groups."""
        self.grad_reduce = "step"
        """The running step's gradient reduction (``begin_step``, from the plan)."""
        self.compute_dtype = compute_dtype
        mp = MixedPrecisionPolicy()
        if compute_dtype is not None:
            # Low-precision compute, float32 reduction; shards keep the model's dtype.
            mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self.offload = layout.dims.state_offload.weights_on_host
        """``state_offload='states'``: shards, gradients and optimizer states live in host memory
        (FSDP2's ``CPUOffloadPolicy``; pinned on CUDA), gathered to the device to run."""
        kw = dict(mesh=self.mesh, mp_policy=mp)
        if self.offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
            stage.compute_device = device  # the parameters say "cpu"; the stage runs here
        host = self._to_meta(stage.hf_model)
        self.modules, self.keep_gathered = self._wrap(stage, fully_shard, kw)
        self.head = self.modules[-1] if stage.is_last else None
        """The LM head (with a tied embedding on a one-stage pipeline): its chunked loss runs it a
        different number of times on each SP rank, so ``unit`` reduces it with the norm."""
        self.root = fully_shard(stage.hf_model, **kw)
        leftover = [n for n, p in stage.hf_model.named_parameters() if not is_dtensor(p)]
        if leftover:
            raise ValueError(f"parameters outside the embeddings, decoder layers, final norm and LM head "
                             f"cannot be sharded here: {leftover[:4]}")
        self._materialize(stage.hf_model, host)
        # The root never runs forward, so FSDP's lazy root initialisation (shared communication
        # state for every group) is triggered by hand, once the shards are real tensors.
        self._root_state()._lazy_init()
        if self.head is not None:
            self._chain_head_reduce()
        for m in self.modules:
            m.set_gradient_divide_factor(1.0)  # sum: losses are already globally normalised
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
            m.set_reduce_scatter_unused_params(True, recurse=False)  # idle replicas send zeros
            # Creates each group's unsharded parameters on every rank, so a rank that runs no unit
            # in a step still joins every reduction; also checks the groups work before step 1.
            m.unshard()
            m.reshard()

    # --- construction --------------------------------------------------------------------
    @staticmethod
    def _shard_mesh(layout: ParallelLayout, mode: ShardMode):
        dims = mode.fsdp_dims
        if len(dims) == 1:
            return layout.mesh[dims[0]]
        if mode.hsdp:
            return layout.mesh[dims]  # 2-D: FSDP2 replicates over dim 0, shards over dim 1
        return layout.mesh[dims]._flatten("_".join(dims))

    @staticmethod
    def _extra_group(layout: ParallelLayout, mode: ShardMode):
        """Group whose ranks hold the same shard and partial gradients FSDP does not sum."""
        dims = [d for d in mode.extra_dims if layout.degree(d) > 1]
        if not dims:
            return None, []
        assert len(dims) == 1, dims  # a sharded mode replicates over at most one dim outside FSDP
        return layout.group_of(dims[0])

    @staticmethod
    def _to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
        """Replace every parameter by a meta one (sharing kept); return the host tensors by name."""
        if any(is_dtensor(p) for p in model.parameters()):
            raise ValueError("the model's parameters are already DTensors (sharded or tensor-parallel); "
                             "pass an ordinary model: the engine shards its stage itself")
        host = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        memo: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                               requires_grad=p.requires_grad)
                module._parameters[name] = memo[id(p)]
        return host

    def _wrap(self, stage, fully_shard, kw) -> tuple[list, set]:
        hf = stage.hf_model
        inner = hf.model
        modules, keep = [], set()
        embed_with_head = stage.is_first and stage.is_last and stage.tie_word_embeddings
        if stage.is_first and not embed_with_head:
            modules.append(fully_shard(inner.embed_tokens, reshard_after_forward=True, **kw))
        for _, layer in stage.decoder_layers():
            modules.append(fully_shard(layer, reshard_after_forward=True, **kw))
        if stage.is_last:
            modules.append(fully_shard(inner.norm, reshard_after_forward=False, **kw))
            # A tied head on the embeddings' stage is one parameter: one group for both modules.
            head = [inner.embed_tokens, hf.lm_head] if embed_with_head else hf.lm_head
            fully_shard(head, reshard_after_forward=False, **kw)
            modules.append(hf.lm_head)  # a grouped pair shares one state: either module drives it
            keep.update(id(m) for m in modules[-2:])
        return modules, keep

    def _materialize(self, model: nn.Module, host: dict[str, torch.Tensor]) -> None:
        buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False)}
        # Allocates local shards (and buffers) only; host-offloaded shards in host memory.
        model.to_empty(device="cpu" if self.offload else self.device)
        with torch.no_grad():
            for module in model.modules():
                for name, b in list(module._buffers.items()):
                    if b is not None and b.device != self.device:
                        module._buffers[name] = b.to(self.device)
            for name, b in model.named_buffers(remove_duplicate=False):
                b.copy_(buffers[name])
            for name, p in model.named_parameters():
                copy_full_(p, host[name])

    def _root_state(self):
        from torch.distributed.fsdp import fully_shard

        return fully_shard.state(self.root)

    # --- a step --------------------------------------------------------------------------
    def _set(self, *, sync: bool, reshard: bool, per_unit: bool = False) -> None:
        """Sync on for every module (``sync``), or, with ``per_unit``, for all but the LM head."""
        for m in self.modules:
            m.set_requires_gradient_sync(sync or (per_unit and m is not self.head), recurse=False)
            keep = id(m) in self.keep_gathered or self.gather_per_step
            m.set_reshard_after_backward(reshard or not keep, recurse=False)
            m.set_reshard_after_forward(not keep and not self.gather_per_step, recurse=False)

    def begin_step(self, grad_reduce: str = "step") -> None:
        """Before a training step's first unit: ``step`` accumulates gradients unreduced until the
        end, ``unit`` reduce-scatters them after every backward (module docstring)."""
        check_grad_reduce_runnable(grad_reduce, self.layout.dims)
        self.grad_reduce = grad_reduce
        self.root.set_is_last_backward(False)
        self._set(sync=False, reshard=False, per_unit=grad_reduce == "unit")
        if self.gather_per_step:
            self._gather_all()

    @staticmethod
    def _group(module):
        return module._get_fsdp_state()._fsdp_param_group

    def _chain_head_reduce(self) -> None:
        """Under ``unit``, reduce the LM head's gradient when the final norm's is reduced: once per
        unit on every rank (the norm runs once per unit, before the head's loss chunks, whose
        number differs between SP ranks), and before the unit's decoder layers run backward."""
        norm, head = self._group(self.modules[-2]), self._group(self.head)
        norm_post_backward = norm.post_backward

        def post_backward(*unused):
            norm_post_backward(*unused)
            if self.grad_reduce == "unit":
                self.head.set_requires_gradient_sync(True, recurse=False)
                head.post_backward()
                self.head.set_requires_gradient_sync(False, recurse=False)

        norm.post_backward = post_backward

    def begin_forward_only(self) -> None:
        """Before an evaluation step (forwards only)."""
        self._set(sync=False, reshard=False)
        if self.gather_per_step:
            self._gather_all()

    def _gather_all(self) -> None:
        # Same module order on every rank of the shard group: their all-gathers pair up.
        for m in self.modules:
            m.unshard()

    def reduce_gradients(self) -> None:
        """After the step's last backward: reduce-scatter the accumulated gradients into the sharded
        ``.grad`` (plus FSDP's all-reduce over DP for ``"hybrid"``) and reshard every module.
        Collective over the shard group: every rank calls it, with or without units this step.
        After per-unit reduction nothing is left to reduce (but a tied head's embedding part):
        ``post_backward`` then only reshards (no second, all-zero reduce-scatter)."""
        per_unit, self.grad_reduce = self.grad_reduce == "unit", "step"
        self._set(sync=not per_unit, reshard=True)
        if per_unit and self.head is not None and len(self._group(self.head).modules) > 1:
            # A tied head grouped with the embeddings: the embeddings' backward runs after the
            # head's reduction in each unit, so their last gradient is reduced here.
            self.head.set_requires_gradient_sync(True, recurse=False)
        self.root.set_is_last_backward(True)
        state = self._root_state()
        # What torch.distributed.pipelining does for an FSDP stage after its last backward.
        for fsdp_state in state._state_ctx.all_states:
            for group in fsdp_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        for m in self.modules:
            m.reshard()
            m.set_requires_gradient_sync(True, recurse=False)  # FSDP's default between steps

    def finish_forward_only(self) -> None:
        """After an evaluation step: reshard everything and drop FSDP's per-pass bookkeeping."""
        self.root.reset_iter_state()

    def abort_step(self) -> None:
        """After a failed step: reshard, and drop the step's unreduced gradients."""
        self.grad_reduce = "step"
        try:
            self.root.reset_iter_state()
        finally:
            for fsdp_state in self._root_state()._state_ctx.all_states:
                for group in fsdp_state._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.unsharded_accumulated_grad = None
                        if hasattr(fsdp_param, "_unsharded_param"):
                            fsdp_param._unsharded_param.grad = None

    # --- reductions outside FSDP ----------------------------------------------------------
    @property
    def holds_distinct_shard(self) -> bool:
        """Whether this rank's shards count in a global sum over ranks: ranks that hold a copy of
        another rank's shard (other DP replicas under ``"sp"``/``"hybrid"``, other SP ranks under
        ``"dp"``) contribute nothing, so each piece of the stage is counted once."""
        lay = self.layout
        spans_dp = "dp" in self.mode.shard_dims
        spans_sp = "sp" in self.mode.shard_dims
        return (spans_dp or lay.dp_rank == 0) and (spans_sp or lay.sp_rank == 0)


def check_grad_reduce_runnable(grad_reduce: str, dims) -> None:
    """``ValueError`` when a plan's ``grad_reduce`` cannot run on the layout ``dims`` (before any
    collective, so every rank refuses the same plan alike)."""
    check_grad_reduce(grad_reduce, allow_auto=False)
    problem = unit_reduce_problem(dims) if grad_reduce == "unit" else None
    if problem is not None:
        raise ValueError(f"the plan reduces gradients per unit, which this engine cannot run: {problem} "
                         f"(layout {dims.label}); plan with the engine's layout or grad_reduce='step'")


def alone_mesh(layout: ParallelLayout, device: torch.device):
    """A one-rank mesh of this rank (FSDP2's CPU offload of an unsharded stage): the layout's SP
    dim when the rank is alone on it and in its DP dim, else ``ValueError``.  A world of one rank
    gets a process group of its own (``HashStore``) when none is initialised."""
    if layout.dims.sp_degree > 1 or layout.dims.dp_degree > 1:
        raise ValueError(f"state_offload='states' on unsharded stages ({layout.dims.label}) runs FSDP2 on each "
                         f"rank alone, which needs sp_degree = dp_degree = 1; shard the stages (shard='sp', "
                         f"'dp', ...) or use state_offload='optimizer'")
    if layout.mesh is not None:
        return layout.mesh["sp"]
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    return init_device_mesh(device.type, (1,), mesh_dim_names=("sp",))
