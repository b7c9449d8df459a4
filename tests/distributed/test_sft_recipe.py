"""The SFT recipe for real: ``recipes/sft_cpu_2proc.sh`` (torchrun, 2 gloo processes, pp 2) fine-tunes
the real SmolLM2-135M-Instruct on conversational data with assistant-only loss; it must log its
losses and pipeline metrics, evaluate, and save a model that ``from_pretrained`` loads."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

pytest.importorskip("torch")
import trl  # noqa: E402,F401  (part of the test install)

from tests.distributed.launch import PYTHON, REPO, _env  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_sft_recipe_trains_evaluates_and_saves_a_loadable_model(tmp_path):
    out = tmp_path / "run"
    env = {**_env(), "LAUNCHER": "torchrun", "PYTHON": str(PYTHON), "OUTPUT_DIR": str(out)}
    cmd = ["bash", str(REPO / "recipes" / "sft_cpu_2proc.sh"), "--max_steps", "2", "--num_examples", "16",
           "--eval_examples", "4", "--tokens_per_step", "512", "--max_length", "256"]
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=560)
    assert p.returncode == 0, p.stdout[-6000:]
    logs = [json.loads(m.replace("'", '"')) for m in re.findall(r"\{'loss': [^}]*\}", p.stdout)]
    assert len(logs) >= 2 and all(float(h["loss"]) > 0 and "bubble_fraction" in h for h in logs[:2]), logs
    assert "eval_loss" in p.stdout and "train_tokens_per_second" in p.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 30 and len(os.listdir(out)) > 3
