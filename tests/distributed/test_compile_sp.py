"""Per-layer compile with Ulysses SP and FSDP2 over the SP group, on 2 gloo processes against the
unsplit float64 reference (``workers/compile_sp.py``); the single-process cases are in
``tests/runtime/stage/test_compile.py``."""
from __future__ import annotations

import pytest

from tests.distributed.launch import run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_compiled_layers_with_sp_and_fsdp_match_hf():
    r = run_torchrun("compile_sp.py", 2, timeout_s=540)
    assert not r.timed_out, f"launch timed out after {r.elapsed_s:.0f}s:\n{r.output[-4000:]}"
    assert r.returncode == 0, f"exit code {r.returncode}:\n{r.output[-6000:]}"
    for case in ("sp2_compiled", "sp2_compiled_fsdp_sp"):
        assert r.output.count(f"CASE {case} OK") == 2, r.output[-4000:]
    assert r.output.count("ALL OK") == 2
