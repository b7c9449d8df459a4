"""The trainer's preflight of the longest sequence a batch may hold against the job's layout: the
bound, fits or not, the largest length and what would fit it (each option planned)."""
import types

import torch

from infinipipe_hf.config import GIB, InfiniPipeConfig
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.trainer.batches.fit_check import FitCheck, check_longest_fits, fit_advice, longest_possible

TINY = ModelSpec.from_config_dict({
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1 << 20})
DIMS = ParallelDims(2, 1, 1, gpus_per_node=2)
BUDGET = 0.12 * GIB


def _check(host_gib: float, config: InfiniPipeConfig | None = None) -> FitCheck:
    return FitCheck(TINY, config or InfiniPipeConfig(pp_degree=2), BUDGET, host_gib * GIB)


def test_the_longest_a_batch_may_hold_is_the_least_bound():
    args = types.SimpleNamespace(tokens_per_step=65536, max_length=None)
    assert longest_possible(args, TINY) == 65536
    assert longest_possible(types.SimpleNamespace(tokens_per_step=1 << 22, max_length=4096), TINY) == 4096
    assert longest_possible(types.SimpleNamespace(), TINY) == 1 << 20  # the model's positions


def test_a_sequence_that_fits_needs_no_advice():
    assert fit_advice(_check(0.0), DIMS, 4096) is None


def test_too_long_names_the_largest_length_and_what_fits_it():
    check = _check(0.0)
    largest = check.largest(DIMS)
    assert check.fits(DIMS, largest) and not check.fits(DIMS, int(largest * 1.125))
    advice = fit_advice(check, DIMS, int(largest * 1.5))
    assert f"the largest this layout trains is about {largest} tokens" in advice
    assert "pp_degree=4 (4 GPUs)" in advice  # twice the stages fits it (planned)
    assert "host memory for the plan (host_memory_gib > 0" in advice  # none given
    with_host = _check(1.0)
    more = with_host.largest(DIMS)
    assert more > largest and with_host.fits(DIMS, more)  # the host tier fits more on the same GPUs
    beyond = int(more * 1.1)
    assert "it would fit with state_offload='optimizer'" in fit_advice(with_host, DIMS, beyond)


def test_states_that_leave_no_room_get_the_planners_advice():
    check = FitCheck(TINY, InfiniPipeConfig(), 0.02 * GIB, 0.0)
    advice = fit_advice(check, ParallelDims(gpus_per_node=2), 1024)
    assert advice.startswith("no sequence fits this layout: the model states") and "pp_degree=" in advice


def test_no_device_budget_no_check():
    args = types.SimpleNamespace(tokens_per_step=1 << 20, max_length=None, device=torch.device("cpu"),
                                 to_infinipipe_config=lambda: InfiniPipeConfig(pp_degree=2, host_memory_gib=0))
    assert check_longest_fits(args, TINY, DIMS, None) is None
    assert "does not fit" in check_longest_fits(args, TINY, DIMS, BUDGET)


def test_the_fit_check_plans_with_the_jobs_gradient_reduction():
    """Reduced once per step, a sharded stage keeps every unsharded fp32 gradient: the fit check
    plans as the engine will, so it trains a shorter sequence than where the planner may choose."""
    dims = ParallelDims(1, 2, 1, "sp", gpus_per_node=2)
    auto, step = (FitCheck(TINY, InfiniPipeConfig(sp_degree=2, shard="sp", grad_reduce=mode), BUDGET, 0.0)
                  for mode in ("auto", "step"))
    n = auto.largest(dims)
    assert auto.fits(dims, n) and not step.fits(dims, n)
