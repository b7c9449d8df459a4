"""``benchmarks/gpu/offload_reach_gpu.py`` runs end to end on CPU with a tiny model (the suite's dry
run of step 7): the longest length with the host tier is longer than without it, the plan at it
offloads layer inputs, and the host tier's measured peak is the plan's predicted host peak."""
import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu import gpu_common, offload_reach_gpu


def test_tiny_cpu_run_reaches_further_with_the_host_tier(tmp_path):
    out = tmp_path / "reach.json"
    assert offload_reach_gpu.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    host, base = res["rows"]
    assert host.get("error") is None and base.get("error") is None, res["rows"]
    assert host["state_offload"] == "optimizer" and base["state_offload"] == "none"
    assert res["longest_with_host_tier"] == host["length"] == host["tokens"]
    assert host["length"] > base["length"] > 0 and base["same_length"] is False  # the longest without it
    tier = host["host_tier"]
    assert host["offloaded_layers"] > 0 and tier["copies_out"] > 0
    # Each offloaded input comes back once; K/V on the host (offload_kv) are read by every later slice.
    assert tier["copies_in"] > tier["copies_out"] if host["offload_kv"] else tier["copies_in"] == tier["copies_out"]
    assert host["host_tier"]["resident_gib"]["optimizer"] > 0 and base["host_peak_gib"] == 0.0
    assert host["host_peak_predicted_over_measured"] == pytest.approx(1.0, abs=0.05)
    assert len(host["step_times_s"]) == 2 and host["measured_step_s"] == host["step_times_s"][-1]
    assert res["tokens_per_s_host_tier_over_without"] > 0 and res["host_memory_gib"] == 0.05
    assert abs(host["loss"] - 5.35) < 0.2  # random init: about log(vocab)


def test_states_on_the_host_are_counted_beside_the_host_tier():
    import torch.distributed as dist

    ours = not dist.is_initialized()  # the engine starts a one-rank group for FSDP2's CPU offload
    args = offload_reach_gpu.parse(["--tiny", "--device", "cpu", "--dtype", "fp32", "--state-offload", "states"])
    dev = torch.device("cpu")
    try:
        row = offload_reach_gpu.configuration(
            dict(gpu_common.TINY_CONFIG), dev, torch.float32, args,
            gpu_common.bench_profile_path(None, torch.float32, dev), offload="states", host_gib=args.host_memory_gib,
            cap=args.max_length)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
    assert row["length"] > 0 and row["host_peak_gib"] > row["host_tier"]["peak_gib"]
    assert row["host_peak_predicted_over_measured"] == pytest.approx(1.0, abs=0.05)


def test_host_memory_defaults_to_the_machine_less_the_margin(monkeypatch):
    import infinipipe_hf.config as config

    monkeypatch.setattr(config, "host_memory_bytes", lambda: 128 * 2**30)
    args = SimpleNamespace(host_memory_gib=None, host_margin=0.25)
    assert offload_reach_gpu.host_memory_gib(args) == 96.0
    assert offload_reach_gpu.host_memory_gib(SimpleNamespace(host_memory_gib=7.0, host_margin=0.25)) == 7.0
    with pytest.raises(SystemExit, match="host-margin"):
        offload_reach_gpu.parse(["--host-margin", "1.5"])
