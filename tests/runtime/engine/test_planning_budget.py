"""The engine's budget comes from the one rule the planner CLI applies (``InfiniPipeConfig.memory_budget``);
a budget left at or below zero is refused; the "no feasible plan" error passes the planner's cause on."""
import types

import pytest
import torch

from infinipipe_hf import InfiniPipeConfig
from infinipipe_hf.config import GIB, planning_budget
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.runtime.engine import planning


def _gpu(monkeypatch, gib: float) -> torch.device:
    monkeypatch.setattr(planning.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=int(gib * GIB)))
    return torch.device("cuda", 0)


def test_engine_budget_is_the_shared_rule(monkeypatch):
    device = _gpu(monkeypatch, 79.1787109375)
    for config in (InfiniPipeConfig(), InfiniPipeConfig(memory_margin=0.0, memory_reserve_gib=0.5)):
        want = planning_budget(79.1787109375 * GIB, config.memory_margin, config.memory_reserve_gib).budget_bytes
        assert planning.memory_budget_bytes(config, device) == want == config.memory_budget(79.1787109375 * GIB).budget_bytes


def test_a_budget_left_at_zero_is_refused_with_what_to_change(monkeypatch):
    with pytest.raises(ValueError, match=r"leaves -0.16 GiB to plan to; give the budget itself \(memory_budget_gib"):
        planning.memory_budget_bytes(InfiniPipeConfig(), _gpu(monkeypatch, 2.0))
    assert planning.memory_budget_bytes(InfiniPipeConfig(memory_budget_gib=1.5), torch.device("cuda", 0)) == 1.5 * GIB


def test_no_feasible_plan_names_the_planners_cause():
    from infinipipe_hf.ir.model_spec import ModelSpec

    spec = ModelSpec.from_json_file(config_path("llama3.1-8b"))
    result = plan_step([16384, 2000], spec, ParallelDims(pp_degree=1), PlanOptions(memory_budget_bytes=60 * GIB))
    with pytest.raises(ValueError) as exc:
        planning.plan_from_result(result, [16384, 2000])
    message = str(exc.value)
    assert message.startswith("no feasible plan for a batch of 2 sequences (18384 tokens, longest 16384): ")
    assert "model states" in message and "pp_degree=3 (3 GPUs" in message and "tokens_per_step" not in message
    silent = types.SimpleNamespace(feasible=False, plan=None, error=None)
    with pytest.raises(ValueError, match="the planner gave no reason; raise memory_budget_gib or pp_degree"):
        planning.plan_from_result(silent, [10])


def test_a_cpu_device_has_no_host_tier_unless_one_is_given():
    """A CPU rank's memory is host memory, already under its budget: offloading would copy within
    the same RAM and count it twice, so the default host budget there is 0; a GPU's is the
    machine's share, and an explicit host_memory_gib holds on either."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert planning.host_budget_bytes(InfiniPipeConfig(), cpu) == 0.0
    assert planning.host_budget_bytes(InfiniPipeConfig(), gpu) == InfiniPipeConfig().host_budget_bytes() > 0
    for device in (cpu, gpu):
        assert planning.host_budget_bytes(InfiniPipeConfig(host_memory_gib=2.0), device) == 2.0 * GIB
    asked = InfiniPipeConfig(state_offload="optimizer")  # states on the host: the tier was asked for
    assert planning.host_budget_bytes(asked, cpu) == asked.host_budget_bytes() > 0


def test_an_engine_on_sdpa_plans_with_the_masked_rectangle_it_runs():
    """Slices with context routed to SDPA run through a dense mask that computes the masked blocks:
    the engine's profile says so (its pairs and its mask bytes) even when it was fitted on flash."""
    from infinipipe_hf.planner.cost.profile import default_profile
    from infinipipe_hf.runtime.attention.sdpa import sdpa_backend

    engine = types.SimpleNamespace(config=InfiniPipeConfig(), runner=types.SimpleNamespace(backend=sdpa_backend),
                                   dtype=torch.float32)
    profile = planning.DefaultPlanner()._load_profile(engine)
    assert default_profile().context_pairs == "band"
    assert profile.context_pairs == "rectangle" and profile.attention_mask_bytes_per_element == 4.0


PLANNING_KNOBS = dict(schedule="seq1f1b", max_tokens_per_unit=4096, num_slices=[2, 4], checkpointing="full",
                      loss_chunk_tokens=1024, sp_rounds=False, grad_reduce="step", solver_time_limit_s=0.5,
                      adopt_rounds_of=("flexsp",))
"""A non-default value of every ``PLAN_SETTINGS`` field but the levels (the engine keeps the runnable ones)."""


def test_the_engines_request_carries_every_planning_setting(monkeypatch):
    """Each ``InfiniPipeConfig.plan_settings()`` value reaches the options every rank plans with."""
    from infinipipe_hf.config import PLAN_SETTINGS
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.planner.search.api import PlanOptions

    assert set(PLANNING_KNOBS) == set(PLAN_SETTINGS) - {"checkpoint_levels"}
    assert all(getattr(PlanOptions(), k) != v for k, v in PLANNING_KNOBS.items())  # each one can fail
    monkeypatch.setattr(planning, "runnable_checkpoint_levels", lambda engine: ("mlp",))
    monkeypatch.setattr(planning.DefaultPlanner, "_load_profile", lambda self, engine: None)
    spec = ModelSpec.from_json_file(config_path("llama2-7b"))
    engine = types.SimpleNamespace(config=InfiniPipeConfig(**PLANNING_KNOBS), device=torch.device("cpu"), spec=spec,
                                   layers_per_stage=[32], layout=types.SimpleNamespace(dims=ParallelDims(pp_degree=1)),
                                   runner=None, dtype=torch.float32)
    options = planning.DefaultPlanner().request(engine)["options"]
    assert {k: getattr(options, k) for k in PLANNING_KNOBS} == {**PLANNING_KNOBS, "num_slices": [2, 4]}
    assert options.checkpoint_levels == ("mlp",)
