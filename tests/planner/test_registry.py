"""The schedule registry: names in order, kinds, lookups and their errors, the recipe's hooks."""
import pytest

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.registry import ALTERNATIVES, PIPELINE_SCHEDULES, SCHEDULES, get_schedule
from infinipipe_hf.planner.schedules.base import PIPELINE, ROUNDS
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineSchedule


def test_names_kinds_and_order():
    assert PIPELINE_SCHEDULES == ("epp", "packed-1f1b", "seq1f1b", "gpipe")
    assert ALTERNATIVES == ("ulysses-zero3", "ring-cp", "ring-cp-packed", "flexsp", "alst")
    assert list(SCHEDULES) == [*PIPELINE_SCHEDULES, *ALTERNATIVES]
    assert all(SCHEDULES[n].kind == PIPELINE for n in PIPELINE_SCHEDULES)
    assert all(SCHEDULES[n].kind == ROUNDS for n in ALTERNATIVES)
    assert [n for n, s in SCHEDULES.items() if s.reference] == ["epp"]
    assert [n for n, s in SCHEDULES.items() if s.one_tail_per_unit] == ["epp"]


def test_get_schedule_errors_name_the_choices():
    assert get_schedule("flexsp").name == "flexsp"
    with pytest.raises(ValueError, match="schedule='flexsp' is not known; use one of epp, packed-1f1b, seq1f1b, gpipe$"):
        get_schedule("flexsp", PIPELINE)
    with pytest.raises(ValueError, match="schedule='zb' is not known; use one of epp, .*, flexsp, alst$"):
        get_schedule("zb")
    with pytest.raises(ValueError, match="schedule='ring-cp' is not known"):
        InfiniPipeConfig(schedule="ring-cp")


def test_checkpoint_policy_and_warmups():
    epp, packed, seq, gpipe = (get_schedule(n) for n in PIPELINE_SCHEDULES)
    assert isinstance(epp, PipelineSchedule)
    assert epp.checkpoint_policy("adaptive") == "adaptive"
    assert {s.checkpoint_policy("adaptive") for s in (packed, seq, gpipe)} == {"uniform"}
    assert packed.checkpoint_policy("full") == "full"
    units = [object()] * 5
    assert packed.warmup(ParallelDims(4), units) == [3, 2, 1, 0]
    assert seq.warmup(ParallelDims(4), units, num_slices=3) == [5, 4, 3, 2]
    assert gpipe.warmup(ParallelDims(3), units) == [5, 5, 5]


def test_knob_records_keep_their_key_order():
    from infinipipe_hf.planner.schedules.baseline import PackKnobs
    from infinipipe_hf.planner.schedules.epp import EPPKnobs

    assert list(EPPKnobs(4, 1.5, True, 8192).record()) == ["num_slices", "estimate_s", "always_planned",
                                                           "unit_token_floor"]
    assert EPPKnobs(1, 0.5).record() == {"num_slices": 1, "estimate_s": 0.5}
    assert PackKnobs(4096).record() == {"pack_tokens": 4096}
    assert list(PackKnobs(4096, 2).record()) == ["pack_tokens", "num_slices"]
    assert list(PackKnobs(4096, 2, "compute").record()) == ["pack_tokens", "num_slices", "slice_balance"]


def test_a_new_schedule_is_one_module_and_one_registry_entry(tmp_path, monkeypatch):
    """The recipe of docs/architecture.md: a module with the schedule's class (here a 1F1B whose
    warm-up is GPipe's less one forward) and its entry in ``SCHEDULES``; nothing else changes, and
    ``schedules/`` has room for it under the architecture test's floor."""
    import importlib.util
    import sys

    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.layout import ParallelDims
    from infinipipe_hf.planner import registry
    from infinipipe_hf.planner.search import api
    from tests.test_architecture import MAX_MODULES_PER_FOLDER, PKG

    module = tmp_path / "toy.py"
    module.write_text(
        "from infinipipe_hf.planner.pipeline.actions import gpipe_warmup\n"
        "from infinipipe_hf.planner.schedules.baseline import BaselineSchedule\n\n\n"
        "class ToySchedule(BaselineSchedule):\n"
        "    name = 'toy'\n\n"
        "    def warmup(self, dims, units, num_slices=1):\n"
        "        return [max(1, w - 1) for w in gpipe_warmup(dims, len(units))]\n")
    spec = importlib.util.spec_from_file_location("toy_schedule", module)
    toy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "toy_schedule", toy)
    spec.loader.exec_module(toy)
    monkeypatch.setitem(registry.SCHEDULES, "toy", toy.ToySchedule())  # the registry entry
    monkeypatch.setattr(api, "PIPELINE_SCHEDULES", (*PIPELINE_SCHEDULES, "toy"))  # derived at import
    model = ModelSpec.from_config_dict(dict(model_type="llama", num_hidden_layers=4, hidden_size=256,
                                            intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                                            vocab_size=1024))
    res = api.plan_step([3000, 900, 400, 200], model, ParallelDims(pp_degree=2), api.PlanOptions(schedule="toy"))
    assert res.feasible and res.plan.schedule == "toy"
    schedules = [p for p in (PKG / "planner" / "schedules").glob("*.py") if p.name != "__init__.py"]
    assert len(schedules) + 1 <= MAX_MODULES_PER_FOLDER
