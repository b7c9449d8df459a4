"""benchmarks/gpu/gpu_suite.sh: a failing or timed-out step is recorded and the next steps still run
(stand-ins for python and nvidia-smi), and the dry run executes every step's Python on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SUITE = REPO / "benchmarks" / "gpu" / "gpu_suite.sh"
OUT_FILES = {"gpu_suite.json", "gpu_suite.log", "gpu_profile.json", "memory_model_check.json",
             "single_gpu.json", "gpu_sim_vs_real.json", "gpu_demo.json", "offload_reach_gpu.json"}
LIMITS = "LIMITS=(0 80 60 55 150 60 35 90)"


def _fake_env(tmp_path, failing: str = "NEVER", sleeping: str = "NEVER") -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Fake GPU, 80 GiB, 1.0'\n")
    fake = bin_dir / "fakepy"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls.txt"}\ncase "$*" in\n'
                    f'  *gpu_suite_report\\ tests*) echo ok ;;\n'
                    f'  *gpu_suite_report*) exec {sys.executable} "$@" ;;\n'
                    f'  *{failing}*) echo "step failed"; exit 3 ;;\n'
                    f'  *{sleeping}*) sleep 30 ;;\nesac\necho ok\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(fake)}


def _steps(out: Path) -> dict:
    return {s["name"]: s for s in json.loads((out / "gpu_suite.json").read_text())["steps"]}


def test_a_failing_step_is_recorded_and_the_next_steps_run(tmp_path):
    env = _fake_env(tmp_path, failing="gpu.gpu_profile")
    p = subprocess.run(["bash", str(SUITE), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    steps = _steps(tmp_path / "out")
    assert steps["profile"]["status"] == "failed" and steps["profile"]["exit_code"] == 3
    assert [s["status"] for n, s in steps.items() if n != "profile"] == ["passed"] * 6
    calls = (tmp_path / "calls.txt").read_text()
    assert "-m benchmarks.gpu.gpu_demo --device cuda --dtype bf16" in calls and "benchmarks.gpu.single_gpu" in calls
    assert "-m benchmarks.gpu.offload_reach_gpu --state-offload optimizer --memory-budget-gib 10" in calls
    assert "1 step(s) failed" in p.stdout


def test_a_step_over_its_limit_is_stopped_and_reported_as_timed_out(tmp_path):
    env = _fake_env(tmp_path, sleeping="gpu.gpu_sim_vs_real")
    suite = tmp_path / "suite.sh"  # the same script with step 5's limit cut to 1 s
    assert LIMITS in SUITE.read_text()
    suite.write_text(SUITE.read_text().replace(LIMITS, "LIMITS=(0 80 60 55 150 1 35 90)")
                     .replace('cd "$(dirname "${BASH_SOURCE[0]}")/../.."', f'cd "{REPO}"'))
    p = subprocess.run(["bash", str(suite), str(tmp_path / "out")], env={**env, "SUITE_STEPS": "5 6"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    steps = _steps(tmp_path / "out")
    assert steps["sim_vs_real"]["status"] == "timed out" and steps["demo_bf16"]["status"] == "passed"
    assert set(steps) == {"sim_vs_real", "demo_bf16"}


def test_an_unknown_step_is_refused(tmp_path):
    p = subprocess.run(["bash", str(SUITE), str(tmp_path / "out")], env={**_fake_env(tmp_path), "SUITE_STEPS": "1 9"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown step '9'" in p.stderr


def test_the_limits_keep_the_suite_within_nine_minutes():
    limits = [int(x) for x in LIMITS.split("(")[1].rstrip(")").split()]
    assert len(limits) == 8 and sum(limits) <= 9 * 60 - 10  # a step over its limit gets 10 s to die


def test_the_gpu_tests_go_into_the_suite_file(tmp_path):
    from benchmarks.gpu import gpu_suite_report

    junit = tmp_path / "j.xml"
    junit.write_text('<testsuite><testcase classname="t" name="a"/><testcase classname="t" name="b">'
                     '<failure message="boom"/></testcase></testsuite>')
    suite = tmp_path / "gpu_suite.json"
    gpu_suite_report.step(suite, "1", "tests_gpu", "0", "3", "75")
    assert gpu_suite_report.tests(junit, suite) == 1
    doc = json.loads(suite.read_text())
    assert doc["gpu_tests"]["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    assert doc["steps"][0]["name"] == "tests_gpu"  # the step records stay


@pytest.mark.slow
def test_dry_run_executes_every_step_on_cpu(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(SUITE), "--dry-run", str(out)], env={**os.environ, "PYTHON": sys.executable},
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert {f.name for f in out.iterdir()} == OUT_FILES  # at most 8 files: what a lease brings back
    assert all(s["status"] == "passed" for s in _steps(out).values()) and len(_steps(out)) == 7
    assert "counts" in json.loads((out / "gpu_suite.json").read_text())["gpu_tests"]
    mem = json.loads((out / "memory_model_check.json").read_text())["rows"]
    assert [r.get("error") for r in mem] == [None] * 4
    kinds = [set(r["unit_kinds"]) for r in mem]
    # the planner may pack the last two cases' short sequences alone or into a hybrid with a slice
    mixed = kinds[2] | kinds[3]
    assert kinds[0] == {"slice"} and kinds[1] == {"packed"} and "slice" in mixed and mixed & {"packed", "hybrid"}
    prof = json.loads((out / "gpu_profile.json").read_text())["models"][0]
    assert "error" not in prof and prof["comparison"]
    sim = json.loads((out / "gpu_sim_vs_real.json").read_text())
    assert "step_predicted_over_measured" in sim and sim["actions"]
    # step 5 simulates with the stage-depth profile it fitted first (per-unit stage costs)
    depth = json.loads((out / "gpu_profile.json").read_text())["stage_depth_profile"]
    assert set(depth["profile"]["stage_unit_s"]) == {"forward", "backward"}
    assert sim["profile"].endswith("tiny.stage.profile.json")
    demo = json.loads((out / "gpu_demo.json").read_text())
    assert len(demo["losses"]) == 2 and demo["eval_loss_after"] < demo["eval_loss_before"]
    reach = json.loads((out / "offload_reach_gpu.json").read_text())
    assert [r.get("error") for r in reach["rows"]] == [None, None]
    assert reach["longest_with_host_tier"] > reach["longest_without_host_tier"] > 0
