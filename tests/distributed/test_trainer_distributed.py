"""EPPTrainer on 2 and 4 CPU processes (gloo), launched by torchrun and by accelerate launch.

Each launch runs many cases (``workers/trainer_cases.py``) against references the plain HF
``Trainer`` computed in this process on the same global batches: pp 2, pp 4, dp 2 x pp 2 and
pp 1 x dp 2 (the latter two also on documents longer than ``tokens_per_step``: every replica fed
pieces of its own) losses/grad norms/weights equal to float64 precision, gradient accumulation, evaluation, exact
resume from a step-2 checkpoint, ``save_model`` loading with ``from_pretrained``, LoRA training
only adapters and saving a ``PeftModel``-loadable adapter, and the pp-not-dividing-world error.
The expected case names are listed here so a case that silently stops running fails the test.
The torchrun runs are parts of the merged launch of their world size (``conftest.py``).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("datasets")

from tests.distributed.launch import REPO, WORKERS, _env, _free_port  # noqa: E402
from tests.distributed.workers.trainer_common import SCENARIOS  # noqa: E402

ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
CPU_CONFIG = REPO / "recipes" / "accelerate" / "cpu_4proc.yaml"
CASES = {
    "pp2": ["pp2_base_eval", "pp2_grad_accum", "pp2_tied_resume_save", "pp2_lora", "pp1dp2_long_docs",
            "pp3_on_2_processes"],
    "world4": ["pp4_tied_eval", "dp2pp2_resume_save", "dp2pp2_long_docs", "pp4_lora", "pp3_on_4_processes"],
    "accel2": ["accel_pp2_base"],
    "accel4": ["accel_pp4_base", "accel_dp2pp2_tied"],
}
pytestmark = pytest.mark.distributed

PLANNER = "default"  # the engine's own planner (workers also take "slicing": a fixed sliced plan)


@pytest.fixture
def ref_dir(trainer_refs):
    return trainer_refs.dir(SCENARIOS)  # every scenario at dp 1 and 2, shared by the session


def _check(returncode: int, output: str, timed_out: bool, suite: str, nproc: int) -> None:
    assert not timed_out, f"{suite}: launch timed out:\n{output[-4000:]}"
    assert returncode == 0, f"{suite}: exit code {returncode}:\n{output[-6000:]}"
    for case in CASES[suite]:
        ranks = set(re.findall(rf"\[rank (\d+)\] CASE {case} OK", output))
        assert ranks == {str(r) for r in range(nproc)}, f"{suite}: case {case} passed on ranks {sorted(ranks)}"
    assert len(re.findall(rf"planner={PLANNER} ALL OK", output)) == nproc


def _accelerate(suite: str, nproc: int, args: list[str], timeout_s: float = 200):
    """``accelerate launch`` with the CPU recipe's config (MULTI_GPU type + use_cpu: gloo ranks)."""
    cmd = [ACCELERATE, "launch", "--config_file", str(CPU_CONFIG), "--num_processes", str(nproc),
           "--main_process_port", str(_free_port()), str(WORKERS / "trainer_cases.py"), suite, *args]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout_s)
        return p.returncode, p.stdout, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -9, out + f"\n(after {time.time() - t0:.0f}s)", True


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("trainer_pp2")  # trainer_cases.py pp2 REFS OUT default
def test_torchrun_pp2_matches_trainer_resume_save_lora(suite_run):
    _check(suite_run.returncode, suite_run.output, suite_run.timed_out, "pp2", 2)


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("trainer_world4")  # trainer_cases.py world4 REFS OUT default
def test_torchrun_pp4_and_dp2_pp2_match_trainer_resume_save_lora(suite_run):
    _check(suite_run.returncode, suite_run.output, suite_run.timed_out, "world4", 4)


@pytest.mark.timeout(240)
def test_accelerate_launch_pp2(ref_dir, tmp_path):
    _check(*_accelerate("accel2", 2, [ref_dir, str(tmp_path), PLANNER]), "accel2", 2)


@pytest.mark.timeout(300)
def test_accelerate_launch_pp4_and_dp2_pp2(ref_dir, tmp_path):
    _check(*_accelerate("accel4", 4, [ref_dir, str(tmp_path), PLANNER]), "accel4", 4)
