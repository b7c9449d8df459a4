"""When nothing fits, the message names the cause with its numbers and what would change it: the
model states (no length fits), one sequence over the largest trainable length, or the batch's
activations; and the recipe settings carry every plan option that differs from the trainer's."""
import dataclasses

import pytest

from infinipipe_hf.config import InfiniPipeConfig, planning_budget
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.layout_search.result import NoLayoutFits, recipe_settings
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.search.finish import infeasible_message
from infinipipe_hf.planner.search.limits import largest_trainable_length, states_fit_options, states_per_gpu

LLAMA31_8B = ModelSpec.from_json_file(config_path("llama3.1-8b"))
LLAMA2_7B = ModelSpec.from_json_file(config_path("llama2-7b"))
H100 = planning_budget(80 * GIB, 0.08, 2.0).budget_bytes  # 71.6 GiB, the trainer's default on 80 GiB


def _states(pp=1, sp=1, dp=1, shard="none", gpus_per_node=8) -> float:
    return states_per_gpu(CostModel(LLAMA31_8B, dims=ParallelDims(pp_degree=pp, sp_degree=sp, dp_degree=dp, shard=shard, gpus_per_node=gpus_per_node), memory_budget_bytes=H100))


def test_model_states_over_the_budget_say_so_with_the_numbers_and_what_fits_them():
    res = plan_step([16384, 8000, 2000], LLAMA31_8B, ParallelDims(pp_degree=1), PlanOptions(memory_budget_bytes=H100))
    assert not res.feasible
    assert f"take {_states() / GIB:.3g} GiB per GPU" in res.error and _states() / GIB > 110
    assert "the 71.6 GiB budget per GPU, so no sequence fits at any length" in res.error
    assert "the largest that fits is" not in res.error and "split or truncate" not in res.error
    # Each option is the fewest GPUs in its direction that fits the states: one fewer does not.
    for option, fits, one_less in (("pp_degree=2 (2 GPUs", _states(pp=2), _states(pp=1)),
                                   ("shard='sp' with sp_degree=4 (4 GPUs", _states(sp=4, shard="sp"),
                                    _states(sp=2, shard="sp")),
                                   ("shard='dp' over dp_degree=4 replicas (4 GPUs", _states(dp=4, shard="dp"),
                                    _states(dp=2, shard="dp"))):
        assert option in res.error and fits < H100 <= one_less
    assert "LoRA" in res.error and "smaller model" in res.error


def test_no_sp_option_without_room_for_an_sp_group():
    cost = CostModel(LLAMA31_8B, dims=ParallelDims(pp_degree=1, gpus_per_node=1), memory_budget_bytes=H100)
    options = states_fit_options(cost)
    assert [o.split(" (")[0] for o in options] == ["pp_degree=2", "shard='dp' over dp_degree=4 replicas"]


def test_one_sequence_too_long_names_the_largest_length_that_fits():
    cost = CostModel(LLAMA31_8B, dims=ParallelDims(pp_degree=4), memory_budget_bytes=H100)
    limit = largest_trainable_length(cost)
    res = plan_step([limit + 1, 1000], LLAMA31_8B, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=H100))
    assert f"sequence 0 of {limit + 1} tokens cannot fit" in res.error
    assert f"the largest that fits is {limit} tokens" in res.error
    assert f"model states take {states_per_gpu(cost) / GIB:.3g} GiB of the 71.6 GiB budget" in res.error
    assert plan_step([limit], LLAMA31_8B, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=H100)).feasible  # the limit itself fits


def test_a_batch_whose_activations_do_not_fit_says_so():
    batch = [30000, 8000, 2000, 1500, 900, 600, 300, 200, 100, 50] * 2
    pp2 = ParallelDims(pp_degree=2)
    # EPP plans it unsliced, within 0.2% of the budget: a candidate its estimate's safety margin
    # alone ruled out, planned because without the margin it ranks first.
    res = plan_step(batch, LLAMA2_7B, pp2, PlanOptions(memory_budget_bytes=H100))
    assert res.feasible and 0.95 * H100 < max(res.simulation.peak_memory_bytes) <= H100
    # GPipe keeps every micro-batch's activations until its backwards: the batch does not fit.
    res = plan_step(batch, LLAMA2_7B, pp2, PlanOptions(schedule="gpipe", memory_budget_bytes=H100))
    assert not res.feasible and "the batch's activations are what does not fit" in res.error
    assert "one static count of layers" in res.error and "tokens_per_step" in res.error
    assert plan_step([30000], LLAMA2_7B, pp2, PlanOptions(memory_budget_bytes=H100)).feasible  # the longest fits alone
    # EPP's message when none of its candidates fits names its checkpointing as already adaptive.
    message = infeasible_message(batch, CostModel(LLAMA2_7B, dims=pp2, memory_budget_bytes=H100), "epp", None)
    assert "the batch's activations are what does not fit" in message and "checkpointing is already adaptive" in message
    res = plan_step(batch, LLAMA2_7B, pp2, PlanOptions(memory_budget_bytes=H100, checkpointing="none"))
    assert "checkpointing='none'; 'adaptive' recomputes layers" in res.error


def test_a_baseline_that_does_not_cut_sequences_names_its_own_limit():
    cost = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4), memory_budget_bytes=H100)
    packed = largest_trainable_length(cost, schedule="packed-1f1b")
    assert packed < largest_trainable_length(cost)
    res = plan_step([packed + 1, 100], LLAMA2_7B, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=H100, schedule="packed-1f1b"))
    assert f"the largest that fits is {packed} tokens" in res.error and "schedule='epp'" in res.error


def test_search_where_states_fit_nowhere():
    with pytest.raises(NoLayoutFits) as exc:
        search_layouts([16384, 8000], LLAMA31_8B, world_size=1, gpus_per_node=1, memory_budget_bytes=H100,
                       alternatives=False)
    message = str(exc.value)
    assert message.startswith("no layout of 1 GPU fits 71.6 GiB per GPU for this batch; the model states")
    assert f"the least: {_states() / GIB:.3g} GiB per GPU, pp 1 x sp 1 x dp 1 shard none" in message
    assert "pp_degree=2 (2 GPUs" in message and "LoRA" in message
    assert exc.value.search.to_dict()["layouts"][0]["model_states_bytes"] == _states(gpus_per_node=1)


def test_search_where_the_longest_sequence_fits_no_layout():
    with pytest.raises(NoLayoutFits) as exc:
        search_layouts([400000, 1000], LLAMA31_8B, world_size=2, gpus_per_node=2, memory_budget_bytes=H100,
                       alternatives=False)
    best = max(exc.value.search.layouts, key=lambda o: o.largest_trainable)
    assert 0 < best.largest_trainable < 400000
    assert (f"the longest sequence has 400000 tokens but the largest any layout trains is {best.largest_trainable} "
            f"({best.layout.label} shard {best.layout.shard})") in str(exc.value)


def test_with_a_host_tier_the_bound_is_named_as_the_devices_alone():
    """A batch of several sequences gets the leanest plan's bound, which keeps activations and K/V
    on the device: with a host tier the message says so instead of passing it off as the limit."""
    with pytest.raises(NoLayoutFits) as exc:
        search_layouts([400000, 1000], LLAMA31_8B, world_size=2, gpus_per_node=2, memory_budget_bytes=H100,
                       host_budget_bytes=1 * GIB, alternatives=False)
    assert "the largest any layout trains with no activations or K/V in host memory" in str(exc.value)


def test_plan_step_defaults_are_the_trainers():
    """``recipe_settings`` leaves out options at ``PlanOptions``' defaults, so they must be the
    trainer's (``InfiniPipeConfig``'s) too."""
    config = {f.name: f.default for f in dataclasses.fields(InfiniPipeConfig)}
    options = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    for name in ("max_tokens_per_unit", "num_slices", "checkpointing", "loss_chunk_tokens", "sp_rounds",
                 "checkpoint_levels"):
        assert options[name] == config[name], name


def test_recipe_settings_carry_the_batch_the_budget_and_non_default_options():
    options = {"max_tokens_per_unit": None, "checkpointing": "adaptive", "checkpoint_levels": ("keep_attn", "mlp",
                                                                                              "mlp_act"),
               "sp_rounds": None}
    assert recipe_settings([100, 50], 0.3 * GIB, options) == {"tokens_per_step": 150, "memory_budget_gib": 0.3}
    changed = {**options, "max_tokens_per_unit": 4096, "checkpoint_levels": (), "sp_rounds": False}
    assert recipe_settings([100], H100, changed) == {"tokens_per_step": 100, "memory_budget_gib": H100 / GIB,
                                                     "max_tokens_per_unit": 4096, "checkpoint_levels": [],
                                                     "sp_rounds": False}
