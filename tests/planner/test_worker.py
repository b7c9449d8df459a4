"""The planner process: the same plans as in-process ``plan_step``, errors and warnings carried back."""

import warnings

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.worker import PlannerProcess, reraise_warnings

SPEC = ModelSpec.from_config_dict(dict(model_type="llama", num_hidden_layers=8, hidden_size=1024,
                                       intermediate_size=2816, num_attention_heads=16,
                                       num_key_value_heads=4, vocab_size=32000))
LENGTHS = [20000, 6000, 3000, 900, 700, 300, 120, 64] * 2
REQUEST = dict(spec=SPEC, dims=ParallelDims(pp_degree=2), options=PlanOptions(memory_budget_bytes=8 * GIB,
                                                                           checkpoint_levels=()))


@pytest.fixture(scope="module")
def process():
    p = PlannerProcess()
    yield p
    p.close()


def test_plans_equal_in_process_plans(process):
    a, b = process.submit(LENGTHS, REQUEST), process.submit(LENGTHS[:5], REQUEST)
    (first, caught), (second, _) = a.result(timeout=120), b.result(timeout=120)
    assert caught == [] and first.feasible and second.feasible
    assert first.plan.to_json() == plan_step(LENGTHS, **REQUEST).plan.to_json()
    assert second.plan.sequences == LENGTHS[:5]


def test_errors_come_back_as_exceptions(process):
    with pytest.raises(ValueError, match="checkpointing='sometimes' is not known"):
        process.submit(LENGTHS, {**REQUEST, "options": PlanOptions(checkpointing="sometimes")}).result(timeout=120)
    assert process.submit([64], REQUEST).result(timeout=120)[0].feasible  # still serving


def test_a_closed_process_fails_its_requests_instead_of_hanging():
    p = PlannerProcess()
    p.close()
    with pytest.raises(RuntimeError, match="planner process"):
        p.submit(LENGTHS, REQUEST).result(timeout=30)


def test_warnings_are_reraised_with_their_category():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reraise_warnings([("RuntimeWarning", "solver hit its time limit"), ("OddWarning", "x")])
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, "solver hit its time limit"),
                                                              (UserWarning, "x")]
