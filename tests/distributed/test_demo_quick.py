"""The README's demo (``python -m infinipipe_hf.demo --quick``) end to end, as a user runs it.

One subprocess launches itself under ``torch.distributed.run`` with 4 gloo processes, fine-tunes
the real SmolLM2-135M for 3 steps of one long-tailed batch, saves an HF checkpoint and generates.
Checks: the plan was printed (every stage's action list) and drawn (a real PNG), the pipelined
loss of step 1 equals the pipelined evaluation of the same batch before training (same weights,
same tokens), the loss fell, the checkpoint loads with ``from_pretrained`` here too and holds the
trained stage-0 tensors, and a sample was generated.  The whole process group is killed on
timeout so a hang cannot outlive the test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # ~1.5 min on an idle 2-core machine; generous for a loaded CI runner


def _run_demo(out: Path) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("LOCAL_RANK", None)  # the demo must launch its own 4 processes
    cmd = [sys.executable, "-m", "infinipipe_hf.demo", "--quick", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # launcher, torchrun and all four ranks
        try:  # a rank in another session could still hold the pipe: never wait on it for long
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            output = "(no output: the pipe stayed open after the kill)"
        pytest.fail(f"the quick demo did not finish within {TIMEOUT_S} s; output tail:\n{output[-4000:]}")
    return proc.returncode, output


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_demo_trains_saves_reloads_and_generates(tmp_path):
    out = tmp_path / "demo"
    rc, output = _run_demo(out)
    assert rc == 0, f"demo failed (exit {rc}):\n{output[-6000:]}"
    summary = json.loads((out / "summary.json").read_text())
    settings = summary["settings"]
    assert settings["pp"] == 4 and settings["world_size"] == 4

    # The plan of step 1 was printed (all four stages' action lists) and drawn.
    assert "plan of step 1" in output
    assert all(f"dp0 stage{s}:" in output for s in range(4))
    plan = summary["plan"]
    assert plan["num_units"] == sum(plan["unit_kinds"].values()) >= 2
    for acts in plan["actions"].values():  # every unit forward and backward on every stage
        assert sorted(acts) == sorted([f"F{u}" for u in range(plan["num_units"])]
                                      + [f"B{u}" for u in range(plan["num_units"])])
    png = Path(plan["gantt_png"])
    import matplotlib.image as mpimg

    img = mpimg.imread(str(png))  # decodes: a real picture of the 4-stage plan, not a stub file
    assert img.shape[1] == 14 * 120 and img.reshape(-1, img.shape[-1]).std(0).max() > 0.05

    # Training: one loss per step; the quick preset has one batch, so step 1's loss (before any
    # update) is the evaluation loss of that batch; then the loss falls.
    losses = summary["losses"]
    assert len(losses) == settings["steps"] == 3
    assert settings["batches_per_epoch"] == 1
    assert losses[0] == pytest.approx(summary["eval_loss_before"], rel=1e-4)
    assert losses[-1] < losses[0] - 0.1
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.1
    assert all(f"step  {i}/3  loss" in output for i in (1, 2, 3))

    # The checkpoint is an ordinary HF model holding the trained weights.
    assert summary["tensors_identical"] == summary["tensors_checked"] > 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) > 100_000_000

    # A sample was generated from the reloaded checkpoint.
    assert summary["sample_tokens"] == 32 and summary["sample"].strip()
    assert "sample (greedy, 32 new tokens)" in output
