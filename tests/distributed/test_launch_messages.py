"""``accelerate launch --cpu --num_processes 2`` starts ONE process (an accelerate quirk): the
trainer must say so and name a command that works, instead of "pp_degree=2 does not divide 1"."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed.launch import REPO, WORKERS, _env, _free_port

pytestmark = pytest.mark.distributed
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


@pytest.mark.timeout(200)
def test_accelerate_cpu_flag_single_process_is_explained():
    cmd = [ACCELERATE, "launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(WORKERS / "launch_probe.py"), "2"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=180)
    assert p.returncode != 0 and "CONSTRUCTED" not in p.stdout, p.stdout[-3000:]
    assert "although --num_processes 2 was asked for" in p.stdout, p.stdout[-3000:]
    assert "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2" in p.stdout
