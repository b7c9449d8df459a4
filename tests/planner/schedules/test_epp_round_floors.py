"""EPP's round floors near the memory budget: the rank's memory cap (what one GPU holds in a
single-GPU unit with every layer checkpointed) is exact, and absent with a host tier."""
from infinipipe_hf.config import planning_budget
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.schedules.epp_ranking import one_rank_token_cap


def _cost(host_gib: float = 0.0, layers_per_stage=None, pp: int = 1) -> CostModel:
    spec = ModelSpec.from_json_file(config_path("llama3.1-8b"))
    budget = planning_budget(48 * GIB, 0.08, 2.0).budget_bytes
    return CostModel(spec, default_profile(), ParallelDims(pp, 4, 1, "sp", 8), memory_budget_bytes=budget,
                     grad_reduce="unit", host_budget_bytes=host_gib * GIB, layers_per_stage=layers_per_stage)


def _fits(cost: CostModel, tokens: int) -> bool:
    one = cost.for_group(1).acts
    return all(one.static_bytes(s) + one.unit_peak_bytes(s, tokens, n) <= cost.memory_budget_bytes
               for s, n in enumerate(cost.layers_per_stage))


def test_the_cap_is_the_most_tokens_that_fit_one_gpu_with_every_layer_checkpointed():
    for cost in (_cost(), _cost(pp=2, layers_per_stage=[20, 12])):
        cap = one_rank_token_cap(cost, 10 ** 6)
        assert 0 < cap < 10 ** 6 and _fits(cost, cap) and not _fits(cost, cap + 1)
    # Never above the tokens asked about; none with a host tier (layer inputs may leave the device).
    assert one_rank_token_cap(_cost(), 1000) == 1000
    assert one_rank_token_cap(_cost(host_gib=64), 10 ** 6) is None
