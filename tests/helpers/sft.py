"""Shared pieces of the SFT tests: SmolLM2's tokenizer, a tiny float64 Llama on its vocabulary, one
small dataset per TRL format, and TRL's own ``SFTTrainer`` as the reference.

Every dataset is small enough that one global batch holds all of it: the reference runs with
``per_device_train_batch_size = len(dataset)`` and ``EPPSFTTrainer`` with a token budget larger
than the dataset, so both train on the same batch every step and their step losses must agree.
"""
from __future__ import annotations

import torch

from infinipipe_hf.models.smollm2 import TRAINING_CHAT_TEMPLATE

PROMPTS = ["The sky is", "Two plus two is", "Paris is the capital of", "Water boils at"]
COMPLETIONS = [" blue.", " four.", " France.", " one hundred degrees Celsius at sea level."]
TEXTS = ["Once upon a time there was a tiny model.", "It learned to predict the next token.",
         "Short.", "A longer line of text, with some punctuation; and numbers 1, 2, 3."]


def tokenizer():
    """A fresh SmolLM2 tokenizer (TRL mutates tokenizers: never share one between trainers)."""
    from infinipipe_hf.models.smollm2 import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def tiny_model(seed: int = 0, num_layers: int = 2, dtype=torch.float64):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer()), hidden_size=32, intermediate_size=72,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-6)
    # SDPA stays in float64 (eager attention's softmax runs in float32).
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def _messages(i: int) -> list[dict]:
    turns = [{"role": "user", "content": PROMPTS[i] + "?"}, {"role": "assistant", "content": COMPLETIONS[i]}]
    if i % 2:  # a second exchange: two assistant spans in one conversation
        turns += [{"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes" + COMPLETIONS[i]}]
    return turns


def dataset(kind: str):
    """One small dataset of the TRL format ``kind``, and the config settings it is trained with."""
    import datasets

    n = len(PROMPTS)
    if kind == "text":
        return datasets.Dataset.from_dict({"text": TEXTS}), {}
    if kind in ("prompt_completion", "prompt_completion_full"):
        over = {} if kind == "prompt_completion" else {"completion_only_loss": False}
        return datasets.Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS}), over
    if kind in ("messages", "messages_assistant_only"):
        over = ({"assistant_only_loss": True, "chat_template_path": str(TRAINING_CHAT_TEMPLATE)}
                if kind == "messages_assistant_only" else {})
        return datasets.Dataset.from_dict({"messages": [_messages(i) for i in range(n)]}), over
    if kind == "conversational_prompt_completion":
        return datasets.Dataset.from_dict({
            "prompt": [[{"role": "user", "content": p + "?"}] for p in PROMPTS],
            "completion": [[{"role": "assistant", "content": c}] for c in COMPLETIONS]}), {}
    if kind in ("pretokenized_completion_mask", "pretokenized_assistant_masks"):
        tok = tokenizer()
        rows = {"input_ids": [], "mask": []}
        for p, c in zip(PROMPTS, COMPLETIONS):
            a, b = tok(p)["input_ids"], tok(c)["input_ids"] + [tok.eos_token_id]
            rows["input_ids"].append(a + b)
            rows["mask"].append([0] * len(a) + [1] * len(b))
        if kind == "pretokenized_completion_mask":
            return (datasets.Dataset.from_dict({"input_ids": rows["input_ids"], "completion_mask": rows["mask"]}),
                    {"completion_only_loss": True})
        return datasets.Dataset.from_dict({"input_ids": rows["input_ids"], "assistant_masks": rows["mask"]}), {}
    raise ValueError(kind)


KINDS = ("text", "prompt_completion", "prompt_completion_full", "messages", "messages_assistant_only",
         "conversational_prompt_completion", "pretokenized_completion_mask", "pretokenized_assistant_masks")


def common_args(max_steps: int = 3, **over) -> dict:
    """Arguments shared by the reference and the pipeline (float64 CPU, SGD: see trainer_common)."""
    return dict(bf16=False, use_cpu=True, report_to=[], max_steps=max_steps, learning_rate=0.05,
                optim="sgd", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                gradient_checkpointing=False, max_grad_norm=1.0, **over)


def trl_reference(kind: str, out_dir: str, max_steps: int = 3, peft_config=None):
    """TRL's ``SFTTrainer`` trained on ``dataset(kind)``, whole dataset per step; returns
    ``(trainer, float64 step losses)``."""
    from trl import SFTConfig, SFTTrainer

    losses: list[float] = []

    class Recording(SFTTrainer):
        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            losses.append(float(loss))
            return loss

    ds, over = dataset(kind)
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=len(ds), **common_args(max_steps, **over))
    tr = Recording(model=tiny_model(), args=args, train_dataset=ds, processing_class=tokenizer(),
                   peft_config=peft_config)
    tr.train()
    return tr, losses


def epp_sft(kind: str, out_dir: str, pp: int = 1, max_steps: int = 3, peft_config=None, planner=None, **extra):
    """``EPPSFTTrainer`` on ``dataset(kind)`` with a token budget above the dataset's size."""
    from infinipipe_hf import EPPSFTConfig, EPPSFTTrainer

    ds, over = dataset(kind)
    args = EPPSFTConfig(output_dir=out_dir, pp_degree=pp, tokens_per_step=4096,
                        **common_args(max_steps, **over), **extra)

    class Recording(EPPSFTTrainer):
        micro_losses: list[float]

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            self.micro_losses.append(float(loss))
            return loss

    Recording.micro_losses = []
    tr = Recording(model=tiny_model(), args=args, train_dataset=ds, processing_class=tokenizer(),
                   peft_config=peft_config, planner=planner)
    tr.micro_losses = []
    return tr
