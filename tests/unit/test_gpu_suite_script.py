"""benchmarks/gpu_suite.sh stops with the failing step's status (set -e with pipefail), run here
with stand-ins for nvidia-smi and python."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, steps: str, failing: str = ""):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'name, memory.total'\necho 'Fake GPU, 80 GiB'\n")
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "fakepy"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in\n'
                    f'  *{failing or "NEVER"}*) echo "step failed" ; exit 3 ;;\nesac\necho ok\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(fake),
           "SUITE_STEPS": steps}
    p = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), str(tmp_path / "out")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    return p, (calls.read_text() if calls.exists() else "")


def test_a_failing_step_fails_the_suite_and_stops_it(tmp_path):
    p, calls = _run(tmp_path, "1 2 3", failing="infinipipe_hf.profile")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "tests/gpu" in calls and "infinipipe_hf.profile" in calls and "single_gpu.py" not in calls
    assert "every step passed" not in p.stdout


def test_all_steps_passing_and_an_unknown_step(tmp_path):
    p, calls = _run(tmp_path, "1 2 3 4")
    assert p.returncode == 0 and "every step passed" in p.stdout, p.stdout + p.stderr
    assert "memory_model_check.py" in calls
    p, _ = _run(tmp_path, "1 9")
    assert p.returncode == 2 and "unknown step '9'" in p.stderr
