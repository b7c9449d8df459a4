"""``alst``: Ulysses SP over the node, ZeRO-3 with host optimizer states (one GPU: host parameters),
every layer checkpointed with its input in host memory, tiled MLP and loss, one sequence at a time."""
import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.alst import ALSTCost, sp_degrees
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.search.api import plan_alternative

SPEC = ModelSpec.from_json_file(config_path("llama3.1-8b"))
HOST = 256 * GIB


def _plan(lengths, world, budget=80 * GIB, host=HOST, **kw):
    cost = FlatCost.of(SPEC, world, budget, None, 8)
    return plan_alternative(lengths, SPEC, "alst", world_size=world, cost=cost, host_budget_bytes=host, **kw)


def test_one_sequence_per_node_group_every_layer_checkpointed_host_bytes_counted():
    lengths = [65536, 32768, 16384, 8192, 4096]
    r = _plan(lengths, 16)
    d = r.summary()
    assert d["feasible"] and d["state_offload"] == "optimizer"
    assert r.plan.checkpoint_layers == SPEC.num_layers
    assert {g.gpus for rnd in r.plan.rounds for g in rnd} == {8}  # the node; DP over the 2 nodes
    assert all(len(g.seqs) == 1 for rnd in r.plan.rounds for g in rnd) and len(r.plan.rounds) == 3
    alst = ALSTCost(FlatCost.of(SPEC, 16, 80 * GIB, None, 8), HOST, 8)
    # Host: the optimizer states' share of this GPU plus every layer's input of its share of the
    # longest sequence (65536 / 8 tokens, 8 KiB each).
    assert d["host_peak_memory_bytes"] == pytest.approx(alst.states.host_bytes + 32 * 8192 * 4096 * 2)
    assert d["peak_memory_bytes"][0] <= 80 * GIB and d["info"]["state_step_tail_s"] > 0
    # Lockstep rounds plus the CPU optimizer step's exposed tail.
    assert d["step_time_s"] == pytest.approx(sum(r.simulation.round_times_s) + d["info"]["state_step_tail_s"])


def test_one_gpu_keeps_every_state_on_the_host():
    d = _plan([131072], 1).summary()
    assert d["feasible"] and d["state_offload"] == "states"
    # Weights, gradients and AdamW moments of 8B parameters on the host (16 bytes each), none on the GPU.
    assert d["host_peak_memory_bytes"] > 16 * 8.0e9
    assert d["peak_memory_bytes"][0] < 40 * GIB


def test_tiled_mlp_keeps_the_intermediates_off_the_per_token_bytes():
    alst = ALSTCost(FlatCost.of(SPEC, 8, 80 * GIB, None, 8), HOST, 8)
    acts = alst.group.cost.acts
    # Per GPU token the device holds less than one layer's untiled activations (MLP included).
    assert alst.per_token_bytes < acts.act_bytes_per_token + 8 * acts.hidden_bytes_per_token
    slope = (alst.device_activation_bytes(8 << 20) - alst.device_activation_bytes(4 << 20)) / ((4 << 20) / 8)
    assert slope == pytest.approx(alst.per_token_bytes)


def test_multi_node_tries_sp_over_every_gpu_and_picks_what_fits():
    cost = FlatCost.of(SPEC, 32, 80 * GIB, None, 8)
    assert sp_degrees(cost) == [8, 32] and sp_degrees(FlatCost.of(SPEC, 4, 80 * GIB, None, 8)) == [4]
    node = ALSTCost(cost, HOST, 8).max_tokens()
    r = _plan([2 * node], 32)
    assert r.feasible and r.plan.knobs["sp_degree"] == 32


def test_without_host_memory_or_checkpoints_it_says_what_it_needs():
    d = _plan([8192], 8, host=0.0).summary()
    assert not d["feasible"] and "host budget is 0" in d["error"] and "--host-memory-gib" in d["error"]
    d = _plan([50_000_000], 8).summary()
    assert not d["feasible"] and "sequence 0 of 50000000 tokens does not fit on 8 GPU(s)" in d["error"]
    with pytest.raises(ValueError, match="alst checkpoints every layer"):
        _plan([8192], 8, checkpointing="none")
