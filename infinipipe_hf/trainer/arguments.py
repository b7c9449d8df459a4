"""``EPPTrainingArguments``: ``transformers.TrainingArguments`` plus the pipeline and data knobs.

Design: a ``Trainer`` script keeps its arguments and adds ``pp_degree`` (and usually
``tokens_per_step``).  The pipeline settings are not declared here: they are generated from
``InfiniPipeConfig`` (``pipeline_arguments.PipelineArguments``), so every config field is an
argument with the same type, default and help, and ``to_infinipipe_config`` passes all of them on.
Settings of ``TrainingArguments`` that mean something different under a token-budget pipeline are
either mapped (``ddp_timeout`` becomes the point-to-point timeout, ``label_smoothing_factor`` the
loss's label smoothing), or ignored with a warning that says what decides instead
(``per_device_train_batch_size``: the token budget), or rejected with a ``ValueError`` when
running with them would be wrong (``fp16`` needs a loss scaler the pipeline does not have;
FSDP/DeepSpeed would shard what the pipeline already splits).  Trade-off:
``per_device_*_batch_size`` default to ``None`` here (not 8) so we can tell a value the user set
from the default; after the checks they are set to 1 so HF's bookkeeping (``train_batch_size``,
logs) keeps working.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.planner.cost.profile import PROFILE_NAMES
from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.auto_layout import check_auto_fields, is_auto
from infinipipe_hf.trainer.hf_conventions.parallelism import apply_parallelism_config, refuse_deepspeed
from infinipipe_hf.trainer.nonfinite import NONFINITE_POLICIES
from infinipipe_hf.trainer.pipeline_arguments import PipelineArguments, config_kwargs, rename_in_message

LONG_DOCUMENT_POLICIES = ("split", "reject")


@dataclass
class EPPTrainingArguments(PipelineArguments, TrainingArguments):
    """``TrainingArguments`` for :class:`~infinipipe_hf.trainer.EPPTrainer` (elastic pipeline), with
    every ``InfiniPipeConfig`` setting (``pp_degree``, ``epp_schedule``, ``sp_degree``...) as a field."""

    tokens_per_step: int = field(default=16384, metadata={
        "help": "Token budget of one global batch (all DP replicas together); replaces the batch size."})
    """Token budget of one global batch: the sampler fills it with whole documents (or pieces of
    long ones).  Each of the ``dp_degree`` replicas gets an even share and sequences of its own; a
    piece longer than a share is one replica's work (such a step holds more than the budget).
    With ``gradient_accumulation_steps=n`` one optimizer step sees up to n budgets."""

    long_document_policy: str = field(default="split", metadata={
        "help": "Documents longer than the model's max positions or tokens_per_step: split or reject."})
    """``split``: cut such a document into independent pieces of at most the limit;
    ``reject``: raise a ValueError naming the document."""

    peak_tflops: float | None = field(default=None, metadata={
        "help": "Peak TFLOP/s of one device for the MFU estimate; default: from the profile on GPU."})
    """Peak dense TFLOP/s of one device, for the logged MFU; ``None``: the profile's value on
    CUDA, no MFU on CPU."""

    plan_ahead: bool = field(default=True, metadata={
        "help": "Plan the next global batch in a planner process while the current one trains."})
    """Plan one batch ahead in a planner process (an injected planner: a worker thread), off the
    critical path and off the training loop's GIL; ``False`` plans each
    batch when its step starts."""

    resume_on_restart: bool = field(default=True, metadata={
        "help": "After a launcher restart (torchrun --max-restarts), resume from the newest complete checkpoint."})
    """When the launcher restarted the job (``TORCHELASTIC_RESTART_COUNT > 0``) and ``train()``
    is not told where to resume, resume from the newest complete checkpoint in ``output_dir``
    (``resume_from_checkpoint=True``), or start from step 0 when there is none."""

    nonfinite_policy: str = field(default="stop", metadata={
        "help": "A NaN/inf loss or gradient norm: 'stop' (raise, naming step, ranks, units) or 'skip' the step."})
    """What a step whose loss or gradient norm is NaN or infinite does, decided alike on every rank
    before the optimizer step: ``stop`` raises ``NonFiniteError`` naming the step, the ranks
    holding non-finite gradients and the units whose loss was not finite (no update, no
    checkpoint of that step); ``skip`` drops that step's update (no optimizer step, weight decay
    or momentum; the LR scheduler holds, as HF does after an fp16 overflow; ``global_step`` still
    advances), warns naming it and logs the count as ``nonfinite_skipped_steps``.  Either way a
    checkpoint whose parameters are not finite is never saved."""

    per_device_train_batch_size: int | None = field(default=None, metadata={
        "help": "Ignored by EPPTrainer: tokens_per_step decides the global batch."})
    """Ignored (warning when set): the token budget ``tokens_per_step`` forms the batches."""

    per_device_eval_batch_size: int | None = field(default=None, metadata={
        "help": "Ignored by EPPTrainer: evaluation batches are filled up to tokens_per_step."})
    """Ignored (warning when set): evaluation batches are filled up to ``tokens_per_step``."""

    def __post_init__(self) -> None:
        # HF's own parallelism settings first, before TrainingArguments.__post_init__ acts on them:
        # deepspeed is refused (transformers would import it), parallelism_config mapped onto the
        # pipeline's fields, which the checks below then validate (hf_conventions/parallelism.py).
        refuse_deepspeed(self)
        apply_parallelism_config(self)
        self._check_epp_fields()
        import torch

        if not self.use_cpu and not torch.cuda.is_available():
            # Without use_cpu HF treats a torchrun/accelerate CPU launch as one process (world 1,
            # every rank "main"), while the pipeline runs on all of them.
            self.use_cpu = True
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(self, name) is not None:
                notices.warn(f"{name}={getattr(self, name)} is ignored by EPPTrainer: batches are "
                             f"filled up to tokens_per_step={self.tokens_per_step} tokens; set "
                             f"tokens_per_step to change the batch size")
            # HF's bookkeeping (train_batch_size, logs, checkpoint comparison) needs an int.
            setattr(self, name, 1)
        super().__post_init__()
        self._check_conflicts()

    def _check_epp_fields(self) -> None:
        if not isinstance(self.tokens_per_step, int) or self.tokens_per_step < 2:
            raise ValueError(f"tokens_per_step must be an integer >= 2 (the token budget of one "
                             f"global batch), got {self.tokens_per_step!r}")
        if self.long_document_policy not in LONG_DOCUMENT_POLICIES:
            raise ValueError(f"long_document_policy={self.long_document_policy!r} is not known; use "
                             f"'split' (cut long documents into pieces) or 'reject' (raise)")
        if self.nonfinite_policy not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_policy={self.nonfinite_policy!r} is not known; use 'stop' "
                             f"(raise at a NaN/inf loss or gradient norm) or 'skip' (skip that step)")
        if self.profile is not None and not os.path.isfile(self.profile) and self.profile not in PROFILE_NAMES:
            raise ValueError(f"profile={self.profile!r} is not a file; pass the JSON written by "
                             f"`python -m infinipipe_hf.profile`, a shipped profile's name "
                             f"({', '.join(PROFILE_NAMES)}) or leave profile=None")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops must be > 0, got {self.peak_tflops}")
        check_auto_fields(self)  # pp_degree="auto": chosen at start-up (auto_layout.py)
        if not is_auto(self):
            self.to_infinipipe_config()  # the config's own checks, in the arguments' names

    def _check_conflicts(self) -> None:
        if self.fp16 or self.fp16_full_eval:
            raise ValueError("fp16=True is not supported by EPPTrainer (the pipeline has no loss "
                             "scaler); use bf16=True, or neither for full precision")
        if self.fsdp:  # deepspeed: refused before TrainingArguments imports it (__post_init__)
            raise ValueError("fsdp cannot be combined with EPPTrainer: the pipeline already splits the "
                             "model across processes and does data parallelism itself; remove fsdp and "
                             "use pp_degree, with shard='dp' or 'sp+dp' to shard each stage's states")
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported by EPPTrainer; lower "
                             "tokens_per_step or set memory_budget_gib instead")
        # transformers >= 5.18 names it activation_checkpointing (gradient_checkpointing an alias).
        if getattr(self, "activation_checkpointing", False) or self.gradient_checkpointing:
            notices.warn(
                f"activation_checkpointing/gradient_checkpointing=True is ignored by EPPTrainer: "
                f"checkpointing={self.checkpointing!r} decides which decoder layers are recomputed per "
                f"(stage, unit); use checkpointing='full' to checkpoint every layer or 'adaptive' to let "
                f"the planner fit the memory budget with the least recompute")
            # Trainer.train would otherwise switch on HF's own checkpointing on the full model.
            self.gradient_checkpointing = False
            if hasattr(self, "activation_checkpointing"):
                self.activation_checkpointing = False
        if self.dataloader_drop_last:
            notices.warn("dataloader_drop_last=True is ignored: the token-budget sampler trains every "
                         "token of an epoch exactly once")
        if self.train_sampling_strategy != "random":
            notices.warn(f"train_sampling_strategy={self.train_sampling_strategy!r} is ignored: "
                         f"EPPTrainer uses its length-aware token-budget sampler (shuffled per epoch "
                         f"with data_seed/seed)")
        # torch_compile / torch_compile_backend / torch_compile_mode become compile_layers /
        # compile_backend / compile_mode (pipeline_arguments.py): each decoder layer is compiled.

    @property
    def place_model_on_device(self) -> bool:
        # The engine moves only this rank's stage to the device; moving the whole model first
        # would need the full model's memory on every GPU.
        return False

    def to_infinipipe_config(self) -> InfiniPipeConfig:
        """The :class:`InfiniPipeConfig` these arguments describe (every one of its fields)."""
        try:
            return InfiniPipeConfig(**config_kwargs(self))
        except ValueError as exc:
            raise ValueError(rename_in_message(str(exc))) from None
