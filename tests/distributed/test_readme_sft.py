"""The README's SFT snippet runs as written (saved as ``sft.py``, ``torchrun --nproc_per_node 2``)
on the offline SmolLM2-135M-Instruct, and its evaluation reports TRL's metrics."""
from __future__ import annotations

import re
import subprocess

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.distributed.launch import REPO, TORCHRUN, _env  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _snippet() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    sft = [b for b in blocks if "EPPSFTTrainer" in b and "load_smollm2" in b]
    assert len(sft) == 1, "the README has one SFT snippet on the offline model"
    return sft[0]


@pytest.mark.timeout(600)
def test_the_readme_sft_snippet_runs_as_written(tmp_path):
    from infinipipe_hf.models.smollm2 import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ValueError as exc:  # the offline model is not installed here
        pytest.skip(str(exc))
    (tmp_path / "sft.py").write_text(_snippet())
    p = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "sft.py"], cwd=tmp_path,
                       env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=560)
    assert p.returncode == 0, p.stdout[-6000:]
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy", "eval_num_tokens"):
        assert f"'{key}'" in p.stdout, (key, p.stdout[-3000:])
    assert "not training-compatible" not in p.stdout
