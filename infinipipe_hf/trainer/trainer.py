"""``EPPTrainer``: ``transformers.Trainer`` running the model as an elastic pipeline.

Like TRL's ``SFTTrainer``, a few hooks are overridden and ``super()`` does the rest:
- ``__init__`` cuts this rank's stage out of the model (``PipelineEngine``, in place), so
  ``self.model`` afterwards holds exactly this rank's parameters under their HF names.
- ``_wrap_model`` returns the stage module, so Trainer never wraps the model in DDP/FSDP nor
  lets accelerate prepare it: the engine does DP itself.  Only the optimizer is prepared.
- ``get_*_dataloader`` build a token-budget ``GlobalBatchLoader`` that yields the *same* global
  batch on every rank (accelerate would shard it).
- ``training_step`` = ``engine.train_step(global batch, num_label_tokens=num_items_in_batch)``:
  n accumulated batches give exactly the gradient of their mean token loss, as HF does.
- Clipping uses the engine's global norm; a NaN/inf loss or norm stops the job or skips the step
  (``nonfinite_policy``, ``nonfinite.py``); saving writes HF checkpoints stage by stage
  (``trainer.checkpoints``); resume restores per-stage optimizer state, scheduler and RNG.
- A whole optimizer step without label tokens updates nothing and is left out of the logged mean
  loss (``skipped_steps`` counts it).
Trade-off: evaluation returns the loss only (logits never leave the last stage), so
``compute_metrics`` is not supported.  The private ``Trainer`` methods overridden here are checked
against the tested transformers range at import (``compat.py``).
"""
from __future__ import annotations

import copy
import math
import os

import torch
import transformers
from transformers import Trainer

from infinipipe_hf.runtime.offload.host_optimizer import offload_optimizer
from infinipipe_hf.runtime.parallel.failures import reporting_failures
from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.arguments import EPPTrainingArguments
from infinipipe_hf.trainer.auto_layout import is_auto, resolve_auto_layout
from infinipipe_hf.trainer.batches.loader import GlobalBatchCollator, build_global_batch_loader, label_token_count
from infinipipe_hf.trainer.batches.prepare import prepare_once
from infinipipe_hf.trainer.batches.tokens import dataset_lengths, prepare_token_dataset
from infinipipe_hf.trainer.checkpoints.adapters import load_adapter_weights, save_adapter
from infinipipe_hf.trainer.checkpoints.layout_file import check_layout
from infinipipe_hf.trainer.checkpoints.optimizer import load_optimizer_state, save_optimizer_state
from infinipipe_hf.trainer.checkpoints.publish import save_checkpoint
from infinipipe_hf.trainer.checkpoints.resume import resolve_resume
from infinipipe_hf.trainer.checkpoints.weights import load_stage_weights, save_full_model
from infinipipe_hf.trainer.compat import check_transformers
from infinipipe_hf.trainer.evaluation import PREDICT_REFUSAL, evaluate_loop
from infinipipe_hf.trainer.launch_check import check_single_process_launch
from infinipipe_hf.trainer.model_setup import (
    build_engine,
    count_parameters,
    hf_model_of,
    is_peft_model,
    launched_world_size,
    peak_flops_per_device,
    preflight,
)
from infinipipe_hf.trainer.nonfinite import guard_of
from infinipipe_hf.trainer.notices import global_rank
from infinipipe_hf.trainer.plan_ahead import PlanAhead
from infinipipe_hf.trainer.step_metrics import StepMetrics, TrainingCounts

check_transformers(transformers.__version__, Trainer)

TRAINING_ARGS_NAME = "training_args.bin"


def _check_trainable(dataset, what: str) -> None:
    """At construction, not at ``train()``: a dataset with nothing to train on is the user's error."""
    if dataset is None:
        return
    if not any(n >= 2 for n in dataset_lengths(dataset)):
        raise ValueError(f"{what} has no document of 2 or more tokens (every example is empty or a "
                         f"single token after tokenization), so there is nothing to train on; check "
                         f"the text column and the tokenizer")


def token_dataset_once(dataset, tokenizer, what: str, output_dir: str):
    """``prepare_token_dataset`` on rank 0, its result loaded by the other ranks (collective)."""
    if isinstance(dataset, dict):
        return {k: token_dataset_once(v, tokenizer, f"{what}[{k!r}]", output_dir) for k, v in dataset.items()}
    if dataset is None:
        return None
    return prepare_once(what, dataset, lambda: prepare_token_dataset(dataset, tokenizer, what=what), output_dir)


def check_trainer_inputs(args, model, model_init, data_collator, kwargs: dict) -> EPPTrainingArguments:
    """Argument errors and ignored arguments, before any data is touched; returns the arguments."""
    if args is None:
        args = EPPTrainingArguments(output_dir="tmp_trainer")
    if not isinstance(args, EPPTrainingArguments):
        raise ValueError(f"EPPTrainer needs EPPTrainingArguments, got {type(args).__name__}; replace "
                         f"TrainingArguments(...) by EPPTrainingArguments(..., pp_degree=N)")
    if model_init is not None:
        raise ValueError("model_init is not supported by EPPTrainer (the stage is cut out of one "
                         "model instance); pass model=... instead")
    if model is None:
        raise ValueError("EPPTrainer needs a model: an AutoModelForCausalLM or a peft PeftModel")
    if data_collator is not None:
        notices.warn(f"data_collator={type(data_collator).__name__} is ignored: EPPTrainer builds "
                     f"unpadded global batches of up to tokens_per_step tokens itself; put label "
                     f"masking into a 'labels' column of the dataset")
    if kwargs.get("compute_metrics") is not None:
        notices.warn("compute_metrics is ignored: evaluation reports the pipeline's loss only "
                     "(logits stay on the last stage)")
        kwargs["compute_metrics"] = None
    if args.neftune_noise_alpha is not None:
        raise ValueError("neftune_noise_alpha is not supported by EPPTrainer; remove it")
    note = None if is_auto(args) else check_single_process_launch(args.pp_degree * args.sp_degree,
                                                                    launched_world_size())
    if note:
        notices.warn(note)
    return args


class EPPTrainer(Trainer):
    """A ``Trainer`` whose model runs as an elastic pipeline over ``pp_degree`` stages.

    Same arguments as ``Trainer``; ``args`` must be :class:`EPPTrainingArguments`.  ``planner``
    (``callable(lengths, engine) -> Plan | PlanResult``) replaces the default planner, for tests
    and experiments.  ``data_collator`` is ignored: the trainer builds unpadded global batches.
    """

    token_metrics = False
    """Report TRL's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` in evaluation
    (``EPPSFTTrainer`` does)."""

    def __init__(self, model=None, args: EPPTrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, model_init=None, *,
                 planner=None, dims=None, **kwargs):
        args = check_trainer_inputs(args, model, model_init, data_collator, kwargs)
        if dims is None:  # a subclass that checked earlier passes the layout it built
            dims = preflight(model, args)  # layout and model errors before any tokenization
        with reporting_failures(global_rank(), list(range(launched_world_size()))):
            train_dataset = token_dataset_once(train_dataset, processing_class, "train_dataset", args.output_dir)
            _check_trainable(train_dataset, "train_dataset")
            eval_dataset = token_dataset_once(eval_dataset, processing_class, "eval_dataset", args.output_dir)
        num_params = count_parameters(model)
        base_config = hf_model_of(model).config
        self._attn_implementation = getattr(base_config, "_attn_implementation", None)
        super().__init__(model=model, args=args, data_collator=GlobalBatchCollator(),
                         train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        self._max_length = int(getattr(base_config, "max_position_embeddings", None) or args.tokens_per_step)
        if is_auto(args):
            resolve_auto_layout(self, base_config, launched_world_size())
        self.engine = build_engine(self.model, args, planner, dims)
        self.is_peft = is_peft_model(self.model)
        self._step_metrics = StepMetrics(num_params, self.engine.layout.world_size,
                                         peak_flops_per_device(args, self.engine.device))
        self.plan_ahead = PlanAhead(self.engine) if args.plan_ahead else None
        self._counts = TrainingCounts()
        self.num_tokens_trained = 0
        """Tokens of every global batch trained by this trainer (TRL's ``num_tokens``)."""

    def _reporting(self):
        """Own errors published for the other ranks; a lost peer re-raised naming who failed first."""
        lay = self.engine.layout
        return reporting_failures(lay.rank, list(range(lay.world_size)), lay.describe)

    # --- model and optimizer ----------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # Not self.model: Trainer then skips accelerator.prepare(model) (no DDP); DP is the engine's.
        return self.engine.stage

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(self.engine.stage.hf_model)
        self.optimizer = offload_optimizer(optimizer, self.engine.layout.dims, self.engine.host_tier)
        return self.optimizer

    # --- data --------------------------------------------------------------------------------
    def _global_loader(self, dataset, shuffle: bool, what: str, dp_degree: int | None = None):
        """Global batches feeding every DP replica (``dp_degree``: the engine's, or a layout's the
        auto-layout search weighs before the engine exists)."""
        args = self.args
        return build_global_batch_loader(
            dataset, tokens_per_step=args.tokens_per_step, max_length=self._max_length,
            long_document_policy=args.long_document_policy,
            seed=args.data_seed if args.data_seed is not None else args.seed, shuffle=shuffle,
            num_workers=args.dataloader_num_workers, pin_memory=False, what=what,
            dp_degree=self.engine.layout.dp_degree if dp_degree is None else dp_degree)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("EPPTrainer: training requires a train_dataset")
        loader = self._global_loader(self.train_dataset, shuffle=True, what="train_dataset")
        if self.plan_ahead is not None:
            loader.lookahead = self.plan_ahead.submit
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        what = "eval_dataset"
        if isinstance(eval_dataset, str):
            what, eval_dataset = f"eval_dataset[{eval_dataset!r}]", self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("EPPTrainer: evaluation requires an eval_dataset")
        dataset = token_dataset_once(dataset, self.processing_class, what, self.args.output_dir)
        return self._global_loader(dataset, shuffle=False, what=what)

    def get_test_dataloader(self, test_dataset):
        dataset = token_dataset_once(test_dataset, self.processing_class, "test_dataset", self.args.output_dir)
        return self._global_loader(dataset, shuffle=False, what="test_dataset")

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        # Every rank holds the whole global batch: the count is already global.
        return batches, sum(label_token_count(b) for b in batches)

    def _track_num_input_tokens(self, inputs):
        if self.args.include_num_input_tokens_seen != "no":
            self.state.num_input_tokens_seen += sum(len(item["input_ids"]) for item in inputs)

    def floating_point_ops(self, inputs) -> int:
        # Trainer sums this over all processes; every rank sees the whole batch.
        tokens = sum(len(item["input_ids"]) for item in inputs)
        return int(6 * self._step_metrics.num_params * tokens / self.engine.layout.world_size)

    # --- training ----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete*
        checkpoint, and a job restarted by its launcher resumes by itself (``resume_on_restart``)."""
        self._counts, self._nonfinite_guard = TrainingCounts(), None
        with self._reporting():
            resume = resolve_resume(resume_from_checkpoint, self.args.output_dir, self.args.resume_on_restart)
            out = super().train(resume, *args, **kwargs)
        # HF computed training_loss before our log() could leave label-free steps out of it.
        return out._replace(training_loss=out.metrics.get("train_loss", out.training_loss))

    def training_step(self, model, inputs, num_items_in_batch=None):
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self._step_metrics.start()
        self._counts.add_batch(inputs, self.state.global_step)
        self.num_tokens_trained += sum(len(item["input_ids"]) for item in inputs)
        n = label_token_count(inputs)
        if n == 0:  # same decision on every rank: the batch is global
            if self.plan_ahead is not None:
                self.plan_ahead.drop(inputs)
            if not num_items_in_batch:  # the whole optimizer step has no label token
                if self._counts.skip_step(self.state.global_step):
                    notices.warn(f"step {self.state.global_step + 1}: no label tokens (every label is "
                                 f"-100), nothing is trained; the step is left out of the logged "
                                 f"loss (see 'skipped_steps')")
            # A label-free micro-batch adds exactly 0 to its step's mean token loss.
            return torch.zeros((), dtype=torch.float64, device=self.args.device)
        total = int(num_items_in_batch) if num_items_in_batch else n
        # The engine divides by the label count of all accumulated batches (HF's
        # num_items_in_batch), so accumulation adds exactly the gradient of the joint mean.
        planned = self.plan_ahead.take(inputs) if self.plan_ahead is not None else None
        out = self.engine.train_step(inputs, plan=planned[0] if planned else None,
                                     num_label_tokens=max(total, n))
        self._step_metrics.add(out, planned[1] if planned else out.simulation)
        guard_of(self).record(out)
        # float64 so callers (and tests) see the engine's loss unrounded.
        return torch.tensor(out.loss, dtype=torch.float64, device=self.args.device)

    def _clip_grad_norm(self, model):
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        norm = self.engine.clip_grad_norm_(math.inf) if grad_norm is None else grad_norm
        # Before every optimizer step (clipping or not): a NaN/inf stops the job or skips the step.
        guard_of(self).decide(norm, self.state.global_step + 1, self.optimizer)
        return norm

    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training log line: add the pipeline's window metrics
            logs.update(self._step_metrics.flush(self.engine.device))
            logs.update(self._counts.correct_window_loss(logs["loss"], self.state.global_step))
            if self.token_metrics:
                logs["num_tokens"] = float(self.num_tokens_trained)
        if "loss" in logs or "train_runtime" in logs:
            logs.update(guard_of(self).log_fields())
        if "train_runtime" in logs:  # the end-of-training metrics
            logs.update(self._counts.final_metrics(logs, self.state.global_step))
        super().log(logs, start_time)

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self, *args, **kwargs):
        with self._reporting():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """The loss and metrics only (``prediction_loss_only=True``); logits never leave the
        pipeline's last stage."""
        if not self.args.prediction_loss_only:
            raise ValueError(PREDICT_REFUSAL)
        with self._reporting():
            return super().predict(*args, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        return evaluate_loop(self, dataloader, description, metric_key_prefix, self.token_metrics)

    # --- saving and resuming -------------------------------------------------------------------
    def _hf_config(self):
        cfg = copy.deepcopy(hf_model_of(self.model).config)
        # The stage switched attention to the pipeline's function; the saved model must not need it.
        cfg._attn_implementation = self._attn_implementation
        return cfg

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective (all ranks): an HF checkpoint (or PEFT adapter) of the whole model."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.is_peft:
            save_adapter(self.engine, self.model, output_dir)
        else:
            base = hf_model_of(self.model)
            save_full_model(self.engine, output_dir, self._hf_config(),
                            getattr(base, "generation_config", None))
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial) -> None:
        save_checkpoint(self, trial)  # written under a staging name, published by one rename

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_optimizer_state(self.engine, self.optimizer, self.lr_scheduler, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        check_layout(self.engine, resume_from_checkpoint)
        if self.is_peft:
            load_adapter_weights(self.engine, self.model, resume_from_checkpoint)
        else:
            load_stage_weights(self.engine, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            load_optimizer_state(self.engine, self.optimizer, self.lr_scheduler, checkpoint,
                                 self.engine.device)

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)
