"""Long documents under data parallelism, as a user first runs them: ``recipes/train.py`` on
Python's stdlib sources with ``tokens_per_step 1024`` on 2 processes, at pp 1 (dp 2), with the
layout search (``pp_degree auto``) and at pp 2.  Most pieces are longer than a replica's share
(512 tokens): every run must feed both replicas, train, and exit 0 with finite losses."""
from __future__ import annotations

import math
import re
import subprocess

import pytest

pytest.importorskip("datasets")

from tests.distributed.launch import REPO, TORCHRUN, _env  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", ["1", "auto", "2"])
def test_stdlib_recipe_with_a_small_token_budget_trains_on_two_processes(tmp_path, pp):
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(REPO / "recipes" / "train.py"),
           "--model", "tiny", "--tiny_layers", "2", "--corpus", "stdlib", "--max_docs", "12", "--eval_docs", "2",
           "--pp_degree", pp, "--tokens_per_step", "1024", "--max_steps", "3", "--logging_steps", "1",
           "--output_dir", str(tmp_path / "run"), "--save_strategy", "no", "--report_to", "none", "--use_cpu"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=280)
    assert p.returncode == 0, p.stdout[-6000:]
    losses = [float(x) for x in re.findall(r"'loss': '([^']+)'", p.stdout)]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), (losses, p.stdout[-3000:])
    assert "cannot feed" not in p.stdout
    if pp == "auto":
        assert "chosen over the first batch(es) of each DP degree" in p.stdout, p.stdout[-3000:]
