"""The profiler's host-tier rows (``host_copy``, ``host_adamw``) and the fit that reads them."""
import json
from importlib import resources

import pytest
import torch

from infinipipe_hf.planner.cost.profile import HardwareProfile, fit_profile, host_fields
from infinipipe_hf.profiling import host


def shipped_rows() -> tuple[list[dict], dict]:
    text = resources.files("infinipipe_hf.profiles").joinpath("h100_bf16_measurements.json").read_text()
    doc = json.loads(text)
    return doc["rows"], doc["reference"]


def copy_row(direction: str, gbps: float) -> dict:
    return {"kind": "host_copy", "direction": direction, "bytes": 1 << 28, "ms": 1.0, "bytes_per_s": gbps * 1e9}


def adamw_row(impl: str, rate: float) -> dict:
    return {"kind": "host_adamw", "impl": impl, "params": 1 << 24, "ms": 1.0, "params_per_s": rate}


def test_the_fit_reads_the_host_rows():
    rows, ref = shipped_rows()
    extra = [copy_row("h2d", 50), copy_row("h2d", 54), copy_row("h2d", 10), copy_row("d2h", 48),
             copy_row("d2h", 46), adamw_row("fused", 3e9), adamw_row("foreach", 1e9), adamw_row("fused", 2e9)]
    p = fit_profile(rows + extra, ref, name="t")
    # the median per direction (h2d 50, d2h 47), the slower direction; the fused rows' median
    assert p.host_bandwidth_bytes_per_s == pytest.approx(47e9)
    assert p.host_optimizer_params_per_s == pytest.approx(2.5e9)
    # the other fields are the fit of the same layer rows
    base = fit_profile(rows, ref, name="t")
    assert p.layer_forward == base.layer_forward and p.elementwise_bytes_per_s == base.elementwise_bytes_per_s
    # a rows document is a profile: fitted on load with the host rows too
    loaded = HardwareProfile.from_dict({"rows": rows + extra, "reference": ref})
    assert loaded.host_optimizer_params_per_s == p.host_optimizer_params_per_s


def test_without_host_rows_the_defaults_stay():
    rows, ref = shipped_rows()
    p = fit_profile(rows, ref, name="t")
    assert p.host_bandwidth_bytes_per_s == HardwareProfile.host_bandwidth_bytes_per_s
    assert p.host_optimizer_params_per_s == HardwareProfile.host_optimizer_params_per_s
    assert host_fields([adamw_row("foreach", 7e8)]) == {"host_optimizer_params_per_s": 7e8}  # no fused row


def test_adamw_row_on_cpu_uses_the_cores_of_one_local_rank(monkeypatch):
    monkeypatch.setattr(host, "host_cores", lambda: 6)
    before = torch.get_num_threads()
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        seen.append(torch.get_num_threads())
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    row = host.measure_adamw(1000, "foreach", ranks=4, tensors=3, warmup=0, repeat=2)
    assert row["threads"] == 1 and row["params"] == 1000 and row["params_per_s"] > 0
    assert seen == [1, 1, 1] and torch.get_num_threads() == before  # first step untimed; threads restored
    assert host.measure_adamw(1000, "fused", ranks=1, tensors=3, warmup=0, repeat=1)["threads"] == 6


def test_host_rows_on_cpu_skip_the_copies_with_a_note():
    notes = []
    rows = host.host_rows(torch.device("cpu"), adamw_params=4096, warmup=0, repeat=1, log=notes.append)
    assert [(r["kind"], r["impl"]) for r in rows] == [("host_adamw", "fused"), ("host_adamw", "foreach")]
    assert any("host copy: skipped" in n for n in notes)
    p = fit_profile(shipped_rows()[0] + rows, shipped_rows()[1], name="cpu")
    assert p.host_optimizer_params_per_s == rows[0]["params_per_s"]


def test_local_ranks_and_bad_arguments(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host.local_ranks(torch.device("cpu")) == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host.local_ranks(torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="fused or foreach"):
        host.measure_adamw(100, "sgd")
    with pytest.raises(ValueError, match="h2d or d2h"):
        host.measure_copy(16, "up", torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host <-> device copies need CUDA")
def test_copy_rows_on_cuda():
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = host.host_rows(dev, adamw_params=4096, copy_bytes=(1 << 20,), warmup=1, repeat=2, log=lambda s: None)
    copies = [r for r in rows if r["kind"] == "host_copy"]
    assert [r["direction"] for r in copies] == ["h2d", "d2h"] and all(r["bytes_per_s"] > 0 for r in copies)
    assert host_fields(rows)["host_bandwidth_bytes_per_s"] == min(r["bytes_per_s"] for r in copies)
