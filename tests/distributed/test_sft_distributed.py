"""EPPSFTTrainer as a 2-stage pipeline (torchrun, gloo) against TRL's SFTTrainer in one process:
same step losses and trained weights on the conversational (assistant-only) and prompt/completion
formats."""
from __future__ import annotations

import json
import re
import warnings

import pytest

pytest.importorskip("torch")
import trl  # noqa: E402,F401  (part of the test install)

from tests.distributed.launch import run_torchrun  # noqa: E402
from tests.distributed.workers.sft_cases import KINDS  # noqa: E402
from tests.helpers import sft  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(400)
def test_torchrun_pp2_sft_matches_sfttrainer(tmp_path):
    from safetensors.torch import save_file

    ref_dir = tmp_path / "refs"
    ref_dir.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in KINDS:
            tr, losses = sft.trl_reference(kind, str(tmp_path / f"ref_{kind}"))
            (ref_dir / f"{kind}.json").write_text(json.dumps({"losses": losses}))
            save_file({n: p.detach().clone() for n, p in tr.model.named_parameters(remove_duplicate=False)},
                      str(ref_dir / f"{kind}.safetensors"))
    r = run_torchrun("sft_cases.py", 2, [str(ref_dir), str(tmp_path / "out")], timeout_s=360)
    assert not r.timed_out and r.returncode == 0, r.output[-6000:]
    for kind in KINDS:
        assert set(re.findall(rf"\[rank (\d+)\] CASE pp2_{kind} OK", r.output)) == {"0", "1"}, r.output[-3000:]
    assert r.output.count("ALL OK") == 2
