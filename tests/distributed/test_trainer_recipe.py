"""The CPU recipe for real: ``recipes/cpu_4proc.sh`` with accelerate launch and with torchrun.

Four gloo processes, pp 4, a tiny random Llama on Python's stdlib sources tokenized with
SmolLM2's tokenizer, two steps and a checkpoint; the saved model must load with
``from_pretrained`` in this process and the run must log its loss and pipeline metrics.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

torch = pytest.importorskip("torch")

from tests.distributed.launch import PYTHON, REPO, _env, _free_port  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_cpu_recipe_trains_and_saves_a_loadable_model(tmp_path, launcher):
    out = tmp_path / "run"
    env = {**_env(), "LAUNCHER": launcher, "PYTHON": str(PYTHON), "PORT": str(_free_port()),
           "OUTPUT_DIR": str(out)}
    cmd = ["bash", str(REPO / "recipes" / "cpu_4proc.sh"), "--max_steps", "2", "--max_docs", "10",
           "--eval_docs", "2", "--tiny_layers", "4", "--save_steps", "2"]
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-6000:]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert len(steps) == 2 and all(h["loss"] > 0 and "bubble_fraction" in h for h in steps), steps
    assert any("eval_loss" in h for h in state["log_history"]) or "eval_loss" in p.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4  # one shard per stage
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 4 and len(os.listdir(out)) > 3
