"""InfiniPipeConfig checks: every bad value is a ValueError saying how to fix it."""
import pytest

from infinipipe_hf import InfiniPipeConfig


def test_defaults_are_valid():
    assert InfiniPipeConfig().schedule == "epp"


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_degree=0), "pp_degree must be a positive integer"),
    (dict(schedule="zb"), "schedule='zb' is not known"),
    (dict(checkpointing="some"), "checkpointing='some'"),
    (dict(pp_degree=2, layer_split=[3]), "layer_split"),
    (dict(memory_budget_gib=0), "memory_budget_gib"),
    (dict(memory_margin=0.6), "memory_margin must be in \\[0, 0.5\\)"),
    (dict(sp_degree=0), "sp_degree must be a positive integer"),
    (dict(shard="zero3"), "shard='zero3' is not known"),
    (dict(checkpoint_levels=("mlp", "attention")), "unknown level\\(s\\) \\['attention'\\]"),
])
def test_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InfiniPipeConfig(**kwargs)


def test_the_layout_is_built_once_against_the_world():
    dims = InfiniPipeConfig(pp_degree=2, shard="dp").layout(4, gpus_per_node=4)
    assert (dims.pp_degree, dims.sp_degree, dims.dp_degree, dims.shard.name, dims.gpus_per_node) == (2, 1, 2, "dp", 4)
    with pytest.raises(ValueError, match=r"pp_degree=3 does not divide world size 4 \(the processes launched\); "
                                         r"use 1, 2, 4"):
        InfiniPipeConfig(pp_degree=3).layout(4)
    with pytest.raises(ValueError, match="dp_degree=1"):
        InfiniPipeConfig(pp_degree=2, dp_degree=1).layout(4)
    assert InfiniPipeConfig(pp_degree=2, sp_degree=2).layout(8).dp_degree == 2
    with pytest.raises(ValueError, match="pp_degree=2 x sp_degree=3 = 6 does not divide world size 4"):
        InfiniPipeConfig(pp_degree=2, sp_degree=3).layout(4)
    with pytest.raises(ValueError, match="shard='hybrid'.*needs dp_degree >= 2 and sp_degree >= 2"):
        InfiniPipeConfig(pp_degree=2, sp_degree=2, shard="hybrid").layout(4)  # runnable, not just priceable


def test_checkpoint_levels_default_on_and_can_be_turned_off():
    assert InfiniPipeConfig().checkpoint_levels == ("keep_attn", "mlp", "mlp_act")
    assert InfiniPipeConfig(checkpoint_levels=[]).checkpoint_levels == ()
    assert InfiniPipeConfig(checkpoint_levels="mlp_act").checkpoint_levels == ("mlp_act",)


@pytest.mark.parametrize("kwargs, match", [
    (dict(host_memory_gib=-1), "host_memory_gib must be >= 0"),
    (dict(state_offload="cpu"), "state_offload='cpu' is not known; use one of none, optimizer, states"),
    (dict(state_offload="optimizer", host_memory_gib=0), "host_memory_gib=0 turns the host tier off"),
])
def test_bad_host_tier_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InfiniPipeConfig(**kwargs)


def test_host_budget_defaults_to_the_machines_share(monkeypatch):
    from infinipipe_hf.config import GIB, host_memory_bytes

    assert InfiniPipeConfig(host_memory_gib=0).host_budget_bytes() == 0
    assert InfiniPipeConfig(host_memory_gib=1.5).host_budget_bytes() == 1.5 * GIB
    total = host_memory_bytes()
    assert total > GIB  # the machine's RAM, read from /proc/meminfo (or sysconf)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert InfiniPipeConfig(memory_margin=0.1).host_budget_bytes() == pytest.approx(total / 4 * 0.9)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert InfiniPipeConfig().host_budget_bytes() == pytest.approx(total * (1 - InfiniPipeConfig.memory_margin))


def test_state_offload_reaches_the_layout():
    dims = InfiniPipeConfig(pp_degree=2, state_offload="optimizer").layout(2)
    assert dims.state_offload.optimizer_on_host and not dims.state_offload.weights_on_host
    dims = InfiniPipeConfig(shard="dp", state_offload="states").layout(2)
    assert dims.state_offload.weights_on_host and dims.shard.sharded
    assert InfiniPipeConfig(pp_degree=2, state_offload="states").layout(2).state_offload.weights_on_host
    assert not InfiniPipeConfig().layout(2).state_offload.offloaded


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "1s", True])
def test_solver_time_limit_must_be_finite_seconds(value):
    with pytest.raises(ValueError, match="solver_time_limit_s=.* must be a finite number of seconds >= 0"):
        InfiniPipeConfig(solver_time_limit_s=value)
    assert InfiniPipeConfig().solver_time_limit_s == 0.0
    assert InfiniPipeConfig(solver_time_limit_s=2).solver_time_limit_s == 2.0


def test_plan_settings_are_every_planning_knob_the_config_and_plan_options_share():
    """``PLAN_SETTINGS`` is what the engine, the trainer's layout search and its fit check pass to
    the planner: every field ``InfiniPipeConfig`` and ``PlanOptions`` share by name (``profile`` is a
    path here, a loaded profile there)."""
    import dataclasses

    from infinipipe_hf.config import PLAN_SETTINGS
    from infinipipe_hf.planner.search.api import PlanOptions

    shared = {f.name for f in dataclasses.fields(InfiniPipeConfig)} & {f.name for f in dataclasses.fields(PlanOptions)}
    assert set(PLAN_SETTINGS) == shared - {"profile"}
    config = InfiniPipeConfig(sp_degree=2, checkpoint_levels=["mlp"], grad_reduce="step", solver_time_limit_s=1)
    settings = config.plan_settings()
    assert set(settings) == set(PLAN_SETTINGS) and settings["checkpoint_levels"] == ("mlp",)
    assert PlanOptions(**settings).grad_reduce == "step" and settings["solver_time_limit_s"] == 1.0
