"""Per-unit work on CUDA without host synchronisation: unit tensors queued from pinned memory,
point-to-point transfers posted from their own stream, and the stage-depth rows on the device."""
import pytest
import torch

from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.parallel.comm import P2PStream
from infinipipe_hf.runtime.stage.unit_tensors import build_unit_tensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_unit_tensors_reach_the_device_unchanged_without_a_pageable_copy():
    batch = [{"input_ids": list(range(3, 4099))}, {"input_ids": list(range(50))}]
    t = build_unit_tensors(Unit(0, (Segment(0, 1024, 4096), Segment(1, 0, 50))), batch)
    torch.cuda._sleep(10_000_000)  # a busy stream: a synchronous copy would wait for it
    moved = t.to("cuda")
    for name in ("input_ids", "position_ids", "labels"):
        assert getattr(moved, name).is_cuda and torch.equal(getattr(moved, name).cpu(), getattr(t, name))
    assert moved.cu_seqlens_q.device.type == "cpu"


def test_transfers_are_posted_from_a_stream_of_their_own_after_the_compute_queued_so_far():
    device = torch.device("cuda")
    p2p = P2PStream(device)
    assert p2p.stream is not None and p2p.stream != torch.cuda.current_stream(device)
    x = torch.ones(1 << 20, device=device)
    y = x * 3  # queued on the compute stream
    with p2p.posting(y):
        assert torch.cuda.current_stream(device) == p2p.stream
        z = y.to(torch.float16)  # the cast runs on the p2p stream, after y was computed
    torch.cuda.current_stream(device).wait_stream(p2p.stream)
    assert torch.equal(z.float(), torch.full_like(x, 3.0))
    assert P2PStream(torch.device("cpu")).stream is None


def test_stage_depth_rows_on_the_device():
    from benchmarks.gpu.gpu_common import TINY_CONFIG, make_model
    from benchmarks.lib.runtime_rows import UnitCase
    from benchmarks.lib.stage_depth import measure_depth_rows, split_depths

    model = make_model({**TINY_CONFIG, "num_hidden_layers": 5}, torch.device("cuda"), torch.bfloat16)
    cases = [UnitCase(((0, 256),)), UnitCase(((128, 256),)), UnitCase(((0, 64),) * 4)]
    rows = measure_depth_rows(model, cases, (1, 3), repeat=2, warmup=1)
    assert {r["depth"] for r in rows} == {1, 3} and all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in rows)
    assert len(split_depths(rows)) == 3
