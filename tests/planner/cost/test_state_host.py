"""Model states in host memory (``planner/cost/state_host.py`` and the offload modes of
``states.py``): device and host bytes per mode and layout worked out from the model's shapes, the
optimizer step's tail, the host copies a ``states``-offloaded stage pays per action, ``none``
unchanged, and a Llama-3.1-8B-shape step that fits one 80 GiB GPU only with its states on host."""
import dataclasses
import math

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import OFFLOAD_TABLE, ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.flat_cost import Zero3States
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.cost.state_host import host_state_bytes_per_param, offloaded_step_tail_s, pipelined_tail_s
from infinipipe_hf.planner.cost.states import (
    BF16_MIXED_ADAM,
    FP32_ADAM,
    StatePrecision,
    sharded_numel,
    unit_reduced_state_bytes,
)
from infinipipe_hf.planner.search.api import PlanOptions, plan_step

# Odd sizes, so shard padding shows: head_dim 6, q 36, kv 18.
CONFIG = dict(vocab_size=101, hidden_size=36, intermediate_size=75, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False, model_type="llama")
SPEC = ModelSpec.from_config_dict(CONFIG)
BW, RATE = 40e9, 1e9  # the default profile's host copy bandwidth and CPU AdamW rate
LAYOUTS = {"one": dict(), "sp": dict(sp_degree=2, shard="sp"), "dp": dict(dp_degree=2, shard="dp")}


def _units(g: int) -> list[int]:
    """Elements one of ``g`` ranks holds of each FSDP unit of a one-stage SPEC: embedding, four
    layers, norm + head; every tensor split on its rows, padded to a multiple of ``g``."""
    h, q, kv, i, v = 36, 36, 18, 75, 101
    rows = lambda r, cols: math.ceil(r / g) * cols  # noqa: E731
    layer = rows(q, h) + 2 * rows(kv, h) + rows(h, q) + 2 * rows(i, h) + rows(h, i) + 2 * rows(h, 1)
    return [rows(v, h)] + [layer] * 4 + [rows(h, 1) + rows(v, h)]


def _cost(mode: str, layout: str = "one", **kw) -> CostModel:
    return CostModel(SPEC, dims=ParallelDims(state_offload=mode, **LAYOUTS[layout]), state_precision=BF16_MIXED_ADAM,
                     **kw)


def test_the_unit_shapes_are_the_models():
    assert sum(_units(1)) == 4 * SPEC.layer_params + 2 * SPEC.embedding_params + SPEC.hidden_size
    assert _cost("none").states.shard_numel[0] == _units(1) and _cost("none", "sp").states.shard_numel[0] == _units(2)


def test_none_is_todays_formulas():
    n, s, m = sum(_units(1)), sum(_units(2)), max(_units(1))
    assert _cost("none").acts.static_bytes(0) == n * 16 == CostModel(SPEC).acts.static_bytes(0)
    assert _cost("none", "sp").acts.static_bytes(0) == s * 12 + n * 4 + 3 * m * 2
    assert _cost("none", "sp", grad_reduce="unit").acts.static_bytes(0) == s * 16 + 3 * m * 2 + m * 4
    assert _cost("none", "dp").acts.static_bytes(0) == s * 12 + n * 4 + n * 2
    for layout in LAYOUTS:
        c = _cost("none", layout)
        assert (c.state_host.host_bytes(0), c.state_host.step_tail_s(0)) == (0.0, 0.0)


@pytest.mark.parametrize("layout,grad_reduce,device", [
    ("one", "step", lambda n, s, m, ms: 8 * n),                      # fp32 weights + gradients
    ("sp", "step", lambda n, s, m, ms: 4 * s + 4 * n + 3 * m * 2),   # weight shard, unsharded fp32 grads, 3 copies
    ("sp", "unit", lambda n, s, m, ms: 8 * s + 3 * m * 2 + 4 * m),   # weight + grad shard, one unit's grad
    ("dp", "step", lambda n, s, m, ms: 4 * s + 4 * n + 2 * n),       # gathered once per step: the whole stage
])
def test_optimizer_offload_bytes(layout, grad_reduce, device):
    g = 1 if layout == "one" else 2
    n, s, m = sum(_units(1)), sum(_units(g)), max(_units(1))
    c = _cost("optimizer", layout, grad_reduce=grad_reduce)
    assert c.acts.static_bytes(0) == c.states.peak_static_bytes(0) == device(n, s, m, max(_units(g)))
    assert c.state_host.host_bytes(0) == (4 + 8 + 4) * s  # fp32 master + moments + gradient buffer
    assert c.acts.static_bytes(0) < _cost("none", layout, grad_reduce=grad_reduce).acts.static_bytes(0)


@pytest.mark.parametrize("layout,device", [
    ("one", lambda n, s, m, ms: 3 * m * 2 + 4 * m + 4 * m),   # 3 copies, one unit's grad, its fp32 copy up
    ("sp", lambda n, s, m, ms: 3 * m * 2 + 4 * m + 4 * ms),   # the fetched copy is a shard
    ("dp", lambda n, s, m, ms: 2 * n + 4 * n),                # fetched and gathered once per step
])
def test_states_offload_bytes(layout, device):
    g = 1 if layout == "one" else 2
    n, s, m = sum(_units(1)), sum(_units(g)), max(_units(1))
    c = _cost("states", layout)
    assert c.acts.static_bytes(0) == device(n, s, m, max(_units(g)))
    assert c.state_host.host_bytes(0) == 16 * s
    assert c.state_host.device_bytes(0) == c.acts.static_bytes(0)


def test_per_param_helpers_for_other_schedules():
    none, opt, states = (OFFLOAD_TABLE[k] for k in ("none", "optimizer", "states"))
    assert [host_state_bytes_per_param(m, FP32_ADAM) for m in (none, opt, states)] == [0, 16, 16]
    assert [FP32_ADAM.kept_bytes_per_param(m) for m in (none, opt, states)] == [12, 4, 0]
    p = StatePrecision(18.0, 4.0, 2.0, 4.0, 12.0)  # an optimizer with three moments
    assert (p.weight_bytes_per_param, host_state_bytes_per_param(opt, p)) == (2.0, 18.0)
    with pytest.raises(ValueError, match="optimizer_bytes_per_param=13.0"):
        StatePrecision(16.0, 4.0, 2.0, 4.0, 13.0)
    assert StatePrecision.from_profile(dataclasses.replace(default_profile(), state_bytes_per_param=10.0)
                                       ).optimizer_bytes_per_param == 6.0


def test_pipelined_tail_by_hand():
    # Equal units, CPU the slowest: the first down, every step, the last up.
    assert pipelined_tail_s([1.0] * 3, [2.0] * 3, [1.0] * 3) == 1 + 6 + 1
    assert pipelined_tail_s([3.0] * 3, [2.0] * 3, [1.0] * 3) == 9 + 3 + 1  # copies down the slowest
    assert pipelined_tail_s([], [], []) == 0.0


def test_step_tail_by_hand():
    u1, u2 = _units(1), _units(2)
    want = max(sum(u1) / RATE, 4 * sum(u1) / BW) + 4 * u1[0] / BW + 4 * u1[-1] / BW
    assert _cost("optimizer").state_host.step_tail_s(0) == pytest.approx(want, rel=1e-12)
    want_sp = sum(u2) / RATE + 4 * u2[0] / BW + 4 * u2[-1] / BW
    assert _cost("optimizer", "sp").state_host.step_tail_s(0) == pytest.approx(want_sp, rel=1e-12)
    # states: gradients are already on host, weights stay there: AdamW alone.
    assert _cost("states").state_host.step_tail_s(0) == pytest.approx(sum(u1) / RATE, rel=1e-12)
    # Fetched and gathered once per step, gradients are reduced on the device and copied down.
    assert _cost("states", "dp").state_host.step_tail_s(0) == pytest.approx(sum(u2) / RATE + 4 * u2[0] / BW)


@pytest.mark.parametrize("mode", ["optimizer", "states"])
def test_step_tail_shrinks_with_faster_copies_and_cpu(mode):
    def tail(bw, rate):
        prof = dataclasses.replace(default_profile(), host_bandwidth_bytes_per_s=bw, host_optimizer_params_per_s=rate)
        return CostModel(SPEC, prof, ParallelDims(state_offload=mode)).state_host.step_tail_s(0)

    bws = [1e6, 1e7, 1e8, 1e9]
    tails = [tail(bw, 1e9) for bw in bws]
    assert all(a >= b for a, b in zip(tails, tails[1:]))
    if mode == "optimizer":
        assert tails[0] > 2 * tails[-1]  # copies of 8 bytes per parameter at 1 MB/s dominate
    assert tail(1e9, 1e6) > tail(1e9, 1e8) > 0
    assert offloaded_step_tail_s(OFFLOAD_TABLE["none"], _units(1), FP32_ADAM, default_profile()) == 0.0


def test_states_offload_actions_pay_the_host_copies():
    shape = UnitShape(4096.0**2, 4096)
    none, states, opt = _cost("none"), _cost("states"), _cost("optimizer")
    fwd = none.compute.forward_time(0, shape)
    fetch = [4 * n / BW for n in _units(1)]  # each unit's fp32 weights copied up
    assert opt.compute.forward_time(0, shape) == fwd  # optimizer offload changes nothing until the step
    assert states.compute.forward_time(0, shape) == pytest.approx(max(fetch) + max(fwd, sum(fetch)), rel=1e-12)
    bwd = none.backward_time(0, shape)
    drain = [4 * n / BW + n / (RATE * 28 / 12) for n in _units(1)]  # down, added on host (memory-bound)
    assert states.backward_time(0, shape) == pytest.approx(max(fetch) + max(bwd, sum(fetch) + sum(drain))
                                                           + max(drain), rel=1e-12)
    assert states.compute.gradient_sync_time(0, bwd) == 0.0  # reduced and drained inside every backward
    slow = CostModel(SPEC, dataclasses.replace(default_profile(), host_bandwidth_bytes_per_s=1e6),
                     ParallelDims(state_offload="states"), state_precision=BF16_MIXED_ADAM)
    assert slow.compute.forward_time(0, shape) > states.compute.forward_time(0, shape)


def test_states_offload_with_replicas_reduces_per_unit():
    one = CostModel(SPEC, dims=ParallelDims(dp_degree=2, state_offload="states"))
    shape = UnitShape(1e6, 1000)
    assert one.compute.gradient_sync_time(0, 1.0) == 0.0  # the all-reduce moved into every backward
    assert one.backward_time(0, shape) > CostModel(SPEC, dims=ParallelDims(state_offload="states")).backward_time(
        0, shape)


LLAMA31_8B = ModelSpec.from_json_file(config_path("llama3.1-8b"))


def test_llama_8b_fits_one_80_gib_gpu_only_with_states_on_host():
    opts = PlanOptions(memory_budget_bytes=80 * GIB, host_memory_budget_bytes=256 * GIB)  # a DGX H100's share
    none = plan_step([32768], LLAMA31_8B, ParallelDims(), opts)
    assert not none.feasible and "model states" in none.error
    res = plan_step([32768], LLAMA31_8B, ParallelDims(state_offload="states"), opts)
    assert res.feasible, res.error
    sim = res.simulation
    assert max(sim.peak_memory_bytes) <= 80 * GIB
    cost = CostModel(LLAMA31_8B, dims=ParallelDims(state_offload="states"), memory_budget_bytes=80 * GIB)
    n = LLAMA31_8B.num_layers * LLAMA31_8B.layer_params + 2 * LLAMA31_8B.embedding_params + LLAMA31_8B.hidden_size
    assert cost.state_host.host_bytes(0) == 16 * n and 16 * n > 80 * GIB
    assert cost.acts.static_bytes(0) < 8 * GIB  # three copies of the largest unit (the embedding) and a gradient
    assert sim.info["state_step_tail_s"] == pytest.approx(n / RATE, rel=1e-12)
    assert sim.step_time_s > sim.info["state_step_tail_s"]


def test_zero3_states_are_unit_reduced_states():
    """What the ZeRO-3 alternatives hold without offload is the per-unit-reduced formula, so they
    price offloaded states with the same function."""
    z = Zero3States(SPEC, default_profile(), 4, 8, BF16_MIXED_ADAM)
    shard = [sharded_numel(u, 4) for u in z.units]
    none, opt, states = (OFFLOAD_TABLE[k] for k in ("none", "optimizer", "states"))
    assert unit_reduced_state_bytes(none, shard, z.unit_numel, BF16_MIXED_ADAM) == z.static_bytes
    m = max(z.unit_numel)
    assert unit_reduced_state_bytes(opt, shard, z.unit_numel, BF16_MIXED_ADAM) == 8 * sum(shard) + 3 * m * 2 + 4 * m
    assert unit_reduced_state_bytes(states, shard, z.unit_numel, BF16_MIXED_ADAM) == 3 * m * 2 + 4 * m + 4 * max(shard)
