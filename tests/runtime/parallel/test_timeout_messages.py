"""Timeout errors name the setting the user controls the deadline with (a parameter of the
layout the engine builds, not a hard-coded name)."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.parallel.comm import HIDDEN, StageComm, Transfer, wait_collective  # noqa: E402
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout  # noqa: E402


class _StuckWork:
    def wait(self, timeout=None):
        raise RuntimeError(f"[gloo] Timed out waiting {timeout} for recv operation to complete")


def _layout(setting):
    kw = {} if setting is None else {"timeout_setting": setting}
    return ParallelLayout(ParallelDims(pp_degree=2), 1, timeout_s=0.01, groups_enabled=False, **kw)


@pytest.mark.parametrize("setting, named", [(None, "InfiniPipeConfig.p2p_timeout_s"),
                                            ("ddp_timeout (EPPTrainingArguments)", "ddp_timeout")])
def test_p2p_and_collective_timeouts_name_the_setting(setting, named):
    layout = _layout(setting)
    comm = StageComm(layout, timeout_s=0.01, device=torch.device("cpu"), dtype=torch.float32)
    t = Transfer(_StuckWork(), torch.empty(2), 0, HIDDEN, 3, True, time.perf_counter())
    with pytest.raises(RuntimeError) as info:
        comm.wait(t, step=7, action="F3")
    msg = str(info.value)
    assert "rank 1 (stage 1, dp 0): step 7, action F3: no hidden states of unit 3 from rank 0" in msg
    assert f"raise {named}" in msg
    with pytest.raises(RuntimeError, match=f"raise {named}"):
        wait_collective(_StuckWork(), timeout_s=0.01, layout=layout, ranks=[0, 1], what="loss sum", step=7)
