# %% [markdown]
# # 04 - Fine-tuning with `EPPTrainer`
#
# `EPPTrainer` is a `transformers.Trainer` whose model runs as an elastic pipeline. A training
# script keeps its shape: swap `Trainer` -> `EPPTrainer`, `TrainingArguments` ->
# `EPPTrainingArguments`, add `pp_degree` and a token budget per step (`tokens_per_step`) in place
# of the batch size. Data is a `datasets` dataset of text (plus a tokenizer) or token ids; a
# length-aware sampler fills each step's token budget with whole documents.
#
# Below, one script file trains a small Llama (SmolLM2's tokenizer and vocabulary, 4 decoder
# layers, random initialisation, so it runs in seconds on a CPU) on real long-tailed text. The
# notebook runs it **in this process** with `pp_degree=1` (world size 1); the very same file runs
# as a 4-stage pipeline with `torchrun` (last cell).

# %%
import runpy
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

SCRIPT = '''\
"""Fine-tune a small Llama on long-tailed real text with EPPTrainer (any pp_degree)."""
import argparse
import os

import datasets
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from infinipipe_hf import EPPTrainer, EPPTrainingArguments
from infinipipe_hf.data.corpus import load_tokenizer
from infinipipe_hf.data.long_tail import long_tailed_mix

parser = argparse.ArgumentParser()
parser.add_argument("--pp_degree", type=int, default=1)
parser.add_argument("--max_steps", type=int, default=24)
parser.add_argument("--output_dir", default="out/finetune")
cli = parser.parse_args()

tokenizer = load_tokenizer()  # SmolLM2's, offline
torch.manual_seed(0)  # the same random model on every rank
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config)

# Whole documents as text: Shakespeare and KJV excerpts plus stdlib files (6K tokens in all).
docs = long_tailed_mix(tokenizer, 6144, long_tokens=640, num_long=4, max_doc_tokens=320)
train_data = datasets.Dataset.from_dict({"text": [tokenizer.decode(d.input_ids[:-1]) for d in docs]})

args = EPPTrainingArguments(
    output_dir=cli.output_dir, pp_degree=cli.pp_degree, tokens_per_step=768,
    max_steps=cli.max_steps, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
    logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
trainer = EPPTrainer(model=model, args=args, train_dataset=train_data, processing_class=tokenizer)
trainer.train()
trainer.save_model(os.path.join(cli.output_dir, "model"))
'''
work = Path(tempfile.mkdtemp(prefix="finetune_"))
script = work / "finetune.py"
script.write_text(SCRIPT)
print(f"wrote {script}")

# %% [markdown]
# ## Run it here: pp 1, world size 1

# %%
import time
import warnings

import transformers

transformers.utils.logging.set_verbosity_error()
out_dir = work / "run"
argv, sys.argv = sys.argv, [str(script), "--pp_degree", "1", "--output_dir", str(out_dir)]
t0 = time.perf_counter()
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = runpy.run_path(str(script), run_name="__main__")
finally:
    sys.argv = argv
trainer = ns["trainer"]
print(f"{trainer.state.global_step} steps in {time.perf_counter() - t0:.0f} s")

# %% [markdown]
# ## The loss curve and what the trainer logged
#
# Besides HF's loss, learning rate and gradient norm, every log line carries the pipeline's
# metrics: tokens/s, the planned bubble fraction and peak memory per stage, recomputed layers.

# %%
logs = [h for h in trainer.state.log_history if "loss" in h]
steps = [h["step"] for h in logs]
losses = [h["loss"] for h in logs]
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(steps, losses, marker=".")
ax.set_xlabel("step")
ax.set_ylabel("training loss (mean token loss)")
ax.set_title("EPPTrainer, pp 1: a 4-layer Llama on stdlib + Shakespeare + KJV text")
ax.grid(alpha=0.3)
plt.show()
print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in logs[-1].items()})
first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
print(f"mean loss of the first 4 steps {first:.3f}, of the last 4 steps {last:.3f}")
assert last < first - 0.5, "the loss must fall clearly"

# %% [markdown]
# The plan of the last step (same planner as at pp 4, here with a single stage), and the saved
# model: an ordinary HF checkpoint that `from_pretrained` loads without infinipipe_hf.

# %%
import torch
from transformers import AutoModelForCausalLM

print(trainer.engine.last_plan)
reloaded = AutoModelForCausalLM.from_pretrained(out_dir / "model")
trained = dict(trainer.engine.named_parameters())
same = all(torch.equal(p, trained[n]) for n, p in reloaded.named_parameters() if n in trained)
print(f"reloaded {sum(p.numel() for p in reloaded.parameters()):,} parameters; identical to the "
      f"trained ones: {same}")
assert same

# %% [markdown]
# ## The same script as a 4-stage pipeline
#
# Nothing in the file changes; `torchrun` starts 4 processes (gloo on CPU, NCCL on GPUs), each
# builds the same model and dataset, cuts out its stage, and runs its part of every plan:

# %%
print(f"torchrun --standalone --nproc_per_node 4 {script.name} --pp_degree 4 --output_dir out/finetune_pp4")
print()
print("With accelerate:  accelerate launch --config_file recipes/accelerate/cpu_4proc.yaml "
      f"{script.name} --pp_degree 4")
print("A complete Trainer-style script with every TrainingArguments flag: recipes/train.py "
      "(recipes/cpu_4proc.sh runs it on 4 CPU processes).")
