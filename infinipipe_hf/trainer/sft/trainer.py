"""``EPPSFTTrainer``: supervised fine-tuning the way TRL users write it, on the elastic pipeline.

A TRL script swaps ``SFTTrainer`` -> ``EPPSFTTrainer`` and ``SFTConfig`` -> ``EPPSFTConfig``.  The
trainer takes what ``SFTTrainer`` takes: a model id or a model, ``peft_config``, a tokenizer,
``formatting_func``, and TRL's dataset formats (text, prompt/completion, conversational
``messages``, pre-tokenized ``input_ids`` with ``labels`` or mask columns).

The data is prepared by TRL's own ``SFTTrainer._prepare_dataset``, run on a stand-in holding the
three attributes it reads, so tokens, loss masks and truncation are exactly ``SFTTrainer``'s; only
``input_ids`` and ``labels`` are kept.  From there it is ``EPPTrainer`` (TRL's ``packing`` and
``padding_free`` are what the pipeline always does, so they are ignored with a warning).
Vision data, ``loss_type='dft'``, ``compute_loss_func``, quantized models and MoE router losses are
refused.  Trade-off: calling a private TRL method ties this file to a TRL release; ``config.py``
refuses an untested TRL at import.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from datasets import IterableDataset
from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin, set_seed
from trl import SFTTrainer
from trl.chat_template_utils import (
    clone_chat_template,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_stop_token_trained,
)
from trl.data_utils import get_dataset_column_names, is_conversational
from trl.trainer.utils import create_model_from_path, get_config_model_id

from infinipipe_hf.layout.state_offload import state_offload
from infinipipe_hf.models.smollm2 import TRAINING_CHAT_TEMPLATE
from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.batches.prepare import prepare_once
from infinipipe_hf.trainer.model_setup import hf_model_of, is_peft_model, preflight
from infinipipe_hf.trainer.sft.config import EPPSFTConfig
from infinipipe_hf.trainer.trainer import EPPTrainer

TEMPLATE_HINT = (f"Pass chat_template_path= a Jinja template whose assistant replies sit inside "
                 f"{{% generation %}}...{{% endgeneration %}}; for SmolLM2 and other ChatML templates "
                 f"infinipipe_hf ships one: chat_template_path=str(infinipipe_hf.models.smollm2."
                 f"TRAINING_CHAT_TEMPLATE) ({TRAINING_CHAT_TEMPLATE})")
"""What to do when TRL has no training version of the tokenizer's chat template."""


@dataclass
class _TRLPreparation:
    """The attributes ``SFTTrainer._prepare_dataset`` reads from its trainer."""

    _tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    completion_only_loss: bool


def _sample(dataset) -> dict:
    return next(iter(dataset))


def _warn_ignored(args: EPPSFTConfig) -> None:
    ignored = {
        "packing": (args.packing, "the token-budget sampler packs and the planner slices every batch"),
        "padding_free": (args.padding_free, "the pipeline never pads"),
        "use_liger_kernel": (args.use_liger_kernel, "stages run the model's own layers"),
    }
    for name, (value, why) in ignored.items():
        if value:
            notices.warn(f"{name}=True is ignored by EPPSFTTrainer: {why}")
    _map_activation_offloading(args)


def _map_activation_offloading(args: EPPSFTConfig) -> None:
    """TRL's ``activation_offloading`` is the pipeline's host tier: the planner may keep layer
    inputs and carried K/V in host memory where recompute alone would not fit or cost more."""
    if not args.activation_offloading:
        return
    if args.host_memory_gib == 0:
        notices.warn("activation_offloading=True, but host_memory_gib=0 turns the host tier off, so "
                     "nothing is offloaded; leave host_memory_gib unset (the machine's memory over its "
                     "ranks) or give a budget in GiB per rank")
    elif args.host_memory_gib is None and args.device.type == "cpu" and not state_offload(args.state_offload).offloaded:
        notices.warn("activation_offloading=True on a CPU device offloads nothing by default: its memory "
                     "is host memory already; give host_memory_gib to keep a separate host tier anyway")
    else:
        notices.info("activation_offloading=True: the planner may offload layer inputs and K/V to host "
                     "memory (host_memory_gib) where that beats recomputing")


def _refuse_unsupported(args: EPPSFTConfig, compute_loss_func, quantization_config) -> None:
    if args.loss_type != "nll":
        raise ValueError(f"loss_type={args.loss_type!r} is not supported by EPPSFTTrainer (its chunked "
                         f"loss is the token negative log-likelihood); use loss_type='nll'")
    if compute_loss_func is not None:
        raise ValueError("compute_loss_func is not supported by EPPSFTTrainer: the loss runs in chunks "
                         "inside the last pipeline stage, where no full logits exist; remove it")
    if quantization_config is not None:
        raise ValueError("quantization_config is not supported by EPPSFTTrainer: pipeline stages "
                         "train floating-point weights; load the model unquantized")
    if args.router_aux_loss_coef:
        raise ValueError("router_aux_loss_coef is not supported by EPPSFTTrainer (no MoE models); "
                         "remove it")


def _sft_config(model, args: EPPSFTConfig | None) -> EPPSFTConfig:
    """``args``, or TRL's default config named after the model."""
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = EPPSFTConfig(f"{name.rstrip('/').split('/')[-1]}-SFT")
    if not isinstance(args, EPPSFTConfig):
        raise ValueError(f"EPPSFTTrainer needs EPPSFTConfig, got {type(args).__name__}; replace "
                         f"SFTConfig(...) by EPPSFTConfig(..., pp_degree=N)")
    return args


def _check_train_dataset(train_dataset) -> None:
    if train_dataset is None:
        raise ValueError("EPPSFTTrainer: train_dataset is required")
    if isinstance(train_dataset, IterableDataset):
        raise ValueError("train_dataset is an IterableDataset; EPPSFTTrainer plans batches from "
                         "document lengths, so it needs a datasets.Dataset (materialise it with "
                         "Dataset.from_generator or .take(n))")


def _trl_preparation(sample: dict, args: EPPSFTConfig, tokenizer) -> _TRLPreparation:
    """The chat template and completion-only decision ``SFTTrainer`` would make for this data."""
    if "image" in sample or "images" in sample:
        raise ValueError("vision datasets are not supported by EPPSFTTrainer; use a text dataset")
    if args.assistant_only_loss and not is_conversational(sample):
        raise ValueError("assistant_only_loss=True needs a conversational dataset ('messages' or "
                         "conversational 'prompt'/'completion'); this one is not")
    chat_template = None
    if args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        try:
            chat_template = get_training_chat_template(tokenizer)
        except ValueError as exc:
            raise ValueError(f"assistant_only_loss=True: {exc} {TEMPLATE_HINT}") from None
    if args.assistant_only_loss and not is_chat_template_stop_token_trained(
            tokenizer, chat_template=chat_template):
        notices.warn("the chat template leaves the assistant's end-of-turn token out of the loss "
                     "mask, so the model may not learn to stop; put it inside "
                     "{% generation %}...{% endgeneration %}")
    completion_only = (("prompt" in sample and "completion" in sample)
                       if args.completion_only_loss is None else bool(args.completion_only_loss))
    return _TRLPreparation(tokenizer, chat_template, completion_only)


@contextlib.contextmanager
def _alone():
    """TRL's preparation without its ``main_process_first`` barriers: ``prepare_once`` runs it on
    one rank while the others wait for the result, so a barrier inside would never be met."""
    import trl.trainer.sft_trainer as sft_module

    original = sft_module.global_then_local_main_first
    sft_module.global_then_local_main_first = contextlib.nullcontext
    try:
        yield
    finally:
        sft_module.global_then_local_main_first = original


class EPPSFTTrainer(EPPTrainer):
    """TRL's ``SFTTrainer`` interface on :class:`EPPTrainer`; ``args`` is an :class:`EPPSFTConfig`."""

    token_metrics = True  # evaluation reports TRL's entropy, mean_token_accuracy and num_tokens

    def __init__(self, model, args: EPPSFTConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None,
                 compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, quantization_config=None, peft_config=None,
                 formatting_func: Callable[[dict], str] | None = None, *, planner=None):
        args = _sft_config(model, args)
        _check_train_dataset(train_dataset)
        _refuse_unsupported(args, compute_loss_func, quantization_config)
        _warn_ignored(args)

        set_seed(args.seed)  # PEFT initialises adapters randomly: same seed as SFTTrainer
        model = self._load_model(model, args)
        processing_class = self._load_tokenizer(model, processing_class, args)
        model, processing_class = self._apply_chat_template_path(model, processing_class, args)
        if peft_config is not None:
            model = self._wrap_peft(model, peft_config)
        dims = preflight(model, args)  # layout and model errors before any tokenization

        self._trl = _trl_preparation(_sample(train_dataset), args, processing_class)
        self._formatting_func = formatting_func
        self._skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
        if self._trl.completion_only_loss and formatting_func is not None and not self._skip_prepare:
            raise ValueError("formatting_func turns the dataset into plain text, which has no completion "
                             "to train on alone; apply it before, or set completion_only_loss=False")

        train_dataset = self._prepare(train_dataset, processing_class, args, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._prepare(v, processing_class, args, k) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._prepare(eval_dataset, processing_class, args, "eval")
        super().__init__(model=model, args=args, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, compute_metrics=compute_metrics,
                         callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, planner=planner, dims=dims)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(["trl", "sft", "infinipipe_hf"])

    # --- model and tokenizer, as SFTTrainer builds them ------------------------------------
    @staticmethod
    def _load_model(model, args: EPPSFTConfig):
        if isinstance(model, str):
            kwargs = dict(args.model_init_kwargs or {})
            kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            kwargs["device_map"] = None  # the pipeline places each stage itself
            return create_model_from_path(model, **kwargs)
        if args.model_init_kwargs is not None:
            notices.warn("model_init_kwargs is ignored: the model is already instantiated")
        return model

    @staticmethod
    def _load_tokenizer(model, processing_class, args: EPPSFTConfig):
        if processing_class is None:
            revision = (args.model_init_kwargs or {}).get("revision")
            processing_class = AutoProcessor.from_pretrained(
                get_config_model_id(hf_model_of(model).config), revision=revision,
                trust_remote_code=args.trust_remote_code)
        if isinstance(processing_class, ProcessorMixin) or not isinstance(processing_class,
                                                                          PreTrainedTokenizerBase):
            raise ValueError(f"processing_class must be a tokenizer (text models only), got "
                             f"{type(processing_class).__name__}")
        if args.eos_token is not None:
            if args.eos_token not in processing_class.get_vocab():
                raise ValueError(f"eos_token={args.eos_token!r} is not in the tokenizer's vocabulary; "
                                 f"use a token the tokenizer has")
            processing_class.eos_token = args.eos_token
            hf_model_of(model).config.get_text_config().eos_token_id = processing_class.eos_token_id
        return processing_class

    @staticmethod
    def _apply_chat_template_path(model, tokenizer, args: EPPSFTConfig):
        path = args.chat_template_path
        if path is None:
            return model, tokenizer
        if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
            with open(path, encoding="utf-8") as fh:
                tokenizer.chat_template = fh.read()
            return model, tokenizer
        if is_peft_model(model):
            raise ValueError("chat_template_path naming a tokenizer adds tokens, which needs the base "
                             "model; pass the base model and peft_config instead of a PeftModel")
        model, tokenizer, _ = clone_chat_template(model, tokenizer, path)
        return model, tokenizer

    @staticmethod
    def _wrap_peft(model, peft_config):
        from peft import PeftConfig, get_peft_model

        if not isinstance(peft_config, PeftConfig):
            raise ValueError(f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got "
                             f"{type(peft_config).__name__}")
        if is_peft_model(model):
            raise ValueError("got a PeftModel and a peft_config; pass the base model with peft_config, "
                             "or the PeftModel alone")
        return get_peft_model(model, peft_config)

    # --- data --------------------------------------------------------------------------------
    def _prepare(self, dataset, processing_class, args: EPPSFTConfig, name: str):
        """TRL's preparation (tokens, labels, truncation), then only ``input_ids`` and ``labels``;
        on rank 0, the other ranks load its result (``prepare_once``)."""
        return prepare_once(f"{name}_dataset", dataset,
                            lambda: self._prepare_here(dataset, processing_class, args, name), args.output_dir)

    def _prepare_here(self, dataset, processing_class, args: EPPSFTConfig, name: str):
        if isinstance(dataset, IterableDataset):
            raise ValueError(f"the {name} dataset is an IterableDataset; pass a datasets.Dataset")
        if self._skip_prepare:
            cols = get_dataset_column_names(dataset)
            if "labels" not in cols and any(c in cols for c in ("completion_mask", "assistant_masks")):
                notices.warn(f"the {name} dataset skips TRL's preparation; its mask columns become the "
                             f"labels (a token is trained where every mask is 1)")
            return dataset
        with _alone():
            prepared = SFTTrainer._prepare_dataset(self._trl, dataset, processing_class, args, False,
                                                   self._formatting_func, name)
        cols = get_dataset_column_names(prepared)
        if "completion_mask" in cols:
            notices.warn(f"the {name} dataset has a completion_mask that is not applied because "
                         f"completion_only_loss is not True (as in SFTTrainer): every token is "
                         f"trained; set completion_only_loss=True to train on completions only")
        return prepared.select_columns([c for c in ("input_ids", "labels") if c in cols])

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        # The same preparation as every other dataset (TRL's), then EPPTrainer's loss-only predict.
        if not self.args.prediction_loss_only:
            return super().predict(test_dataset)  # refuses, naming prediction_loss_only
        test_dataset = self._prepare(test_dataset, self.processing_class, self.args, "test")
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, Any]:
        # A dataset passed here gets the same preparation as the constructor's (like SFTTrainer).
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            tok, args = self.processing_class, self.args
            eval_dataset = ({k: self._prepare(v, tok, args, k) for k, v in eval_dataset.items()}
                            if isinstance(eval_dataset, dict) else self._prepare(eval_dataset, tok, args, "eval"))
        return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                metric_key_prefix=metric_key_prefix)
