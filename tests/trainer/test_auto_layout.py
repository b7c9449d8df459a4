"""``EPPTrainingArguments(pp_degree="auto")``: the layout search at the trainer's start-up.

In one process the only layout is pp 1 x sp 1 x dp 1: the trainer must choose it, log the
search's table, and train exactly as the plain HF ``Trainer`` (float64).  The choice itself on
several processes is the search's (tests/planner/layout_search/test_search.py); here ``choose`` is
checked against ``search_layouts`` on a 4-GPU world, and the errors are checked.
"""
from __future__ import annotations

import logging
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("datasets")

from infinipipe_hf import EPPTrainingArguments  # noqa: E402
from infinipipe_hf.ir.model_spec import ModelSpec  # noqa: E402
from infinipipe_hf.planner.layout_search.search import search_layouts  # noqa: E402
from infinipipe_hf.trainer.auto_layout import choose, search_restrictions  # noqa: E402
from tests.distributed.workers.trainer_common import (  # noqa: E402
    LOSS_RTOL,
    SCENARIOS,
    assert_close_list,
    epp_trainer,
    per_step,
    reference_run,
)
from tests.helpers.reference import tiny_config  # noqa: E402

SPEC = ModelSpec.from_hf_config(tiny_config("llama", num_layers=4))


def _args(tmp_path, **kw) -> EPPTrainingArguments:
    return EPPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def test_auto_in_one_process_chooses_pp1_logs_and_trains_exactly(tmp_path, caplog):
    scn = SCENARIOS["base"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = reference_run(scn, str(tmp_path / "ref"))
        with caplog.at_level(logging.WARNING, logger="infinipipe_hf.trainer.auto_layout"):
            tr = epp_trainer(scn, str(tmp_path / "run"), "auto", sp_degree="auto", shard="auto")
        assert (tr.args.pp_degree, tr.args.sp_degree, tr.args.dp_degree, tr.args.shard) == (1, 1, 1, "none")
        assert "layout search" in caplog.text and "recommended: pp 1 x sp 1 x dp 1" in caplog.text
        tr.train()
    assert_close_list(per_step(tr, scn), ref["losses"], "losses", LOSS_RTOL)


def test_choose_is_the_search_pick_and_respects_restrictions(tmp_path):
    batch = [37, 11, 8, 5, 23, 6, 40, 3, 17, 9, 29, 14, 31, 12, 7, 90]
    args = _args(tmp_path, pp_degree="auto")
    layout, table = choose([batch], SPEC, args, 4, 4, 2**30)
    want = search_layouts(batch, SPEC, world_size=4, gpus_per_node=4, memory_budget_bytes=2**30,
                          alternatives=False).recommended.layout
    assert layout == want and f"chosen over the first batch(es) of each DP degree: {want.label}" in table
    restricted = _args(tmp_path, pp_degree="auto", sp_degree=2, shard="sp")
    assert search_restrictions(restricted) == ((2,), ("sp",))
    layout, _ = choose([batch, batch[:5]], SPEC, restricted, 4, 4, 2**30)
    assert (layout.sp_degree, layout.shard.name) == (2, "sp")


def test_no_valid_layout_for_the_world_is_a_clear_error(tmp_path):
    args = _args(tmp_path, pp_degree="auto")
    with pytest.raises(ValueError, match=r"world size 12 is not a whole number of nodes of 8 GPUs"):
        choose([[10, 20]], SPEC, args, 12, 8, 2**30)
    with pytest.raises(ValueError, match=r"no parallel layout of 1 GPUs .* with sp_degree in \(2,\)"):
        choose([[10, 20]], SPEC, _args(tmp_path, pp_degree="auto", sp_degree=2), 1, 8, 2**30)


def test_no_layout_fits_names_the_largest_trainable_sequence(tmp_path):
    with pytest.raises(ValueError, match=r"Largest trainable sequence per layout"):
        choose([[4000, 20]], SPEC, _args(tmp_path, pp_degree="auto"), 2, 2, 2**21)


def test_trainer_with_no_valid_layout_raises_before_building(tmp_path):
    scn = SCENARIOS["base"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"pp_degree='auto': no parallel layout of 1 GPUs"):
            epp_trainer(scn, str(tmp_path), "auto", sp_degree=2)


@pytest.mark.parametrize("kw, message", [
    ({"pp_degree": 2, "sp_degree": "auto"}, r"sp_degree='auto' needs pp_degree='auto'"),
    ({"pp_degree": "auto", "dp_degree": 2}, r"chooses dp_degree too"),
    ({"pp_degree": "auto", "layer_split": [2, 2]}, r"layer_split=\[2, 2\] cannot be given"),
    ({"pp_degree": "auto", "sp_degree": 0}, r"sp_degree must be a positive integer or 'auto'"),
    ({"pp_degree": "auto", "shard": "rows"}, r"shard"),
    ({"pp_degree": "auto", "epp_schedule": "nope"}, r"epp_schedule"),
])
def test_bad_auto_arguments(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **kw)


def test_each_dp_degree_is_searched_on_its_own_batches_and_unfed_layouts_are_dropped(tmp_path):
    asked = []

    def batches_for(dp):
        asked.append(dp)
        return [[90]] if dp == 2 else [[90, 40]]  # the dp 2 loader could only form a one-sequence batch

    layout, table = choose(batches_for, SPEC, _args(tmp_path, pp_degree="auto"), 2, 2, 2**30)
    assert sorted(asked) == [1, 2] and layout.dp_degree == 1
    assert "1 sequence for 2 DP replicas: a replica would idle" in table
    # fed, the dp 2 layout is planned on its own batches and can win
    layout, table = choose(lambda dp: [[90, 40]], SPEC, _args(tmp_path, pp_degree="auto"), 2, 2, 2**30)
    assert "would idle" not in table


def test_choose_plans_with_every_planning_setting(tmp_path, monkeypatch):
    """The trainer's search gets the job's ``PLAN_SETTINGS`` (the schedule apart: it plans EPP)."""
    from infinipipe_hf.planner.layout_search import search as search_module

    seen, real = {}, search_module.search_layouts
    monkeypatch.setattr(search_module, "search_layouts", lambda *a, **kw: seen.update(kw["plan_options"]) or real(*a, **kw))
    knobs = dict(max_tokens_per_unit=4096, num_slices=[1, 2], checkpointing="full", checkpoint_levels=("mlp",),
                 loss_chunk_tokens=1024, sp_rounds=False, grad_reduce="step", solver_time_limit_s=0.5,
                 adopt_rounds_of=("flexsp",))
    choose([[37, 11, 8, 5]], SPEC, _args(tmp_path, pp_degree="auto", **knobs), 1, 1, 2**30)
    assert seen == knobs


def test_choose_plans_every_layout_in_full_when_it_sums_several_batches(tmp_path, monkeypatch):
    """A layout pruned on one batch (slower than that batch's best) may still have the most tokens/s
    over all of them, so only a single batch is searched with pruning."""
    from infinipipe_hf.planner.layout_search import search as search_module

    pruned, real = [], search_module.search_layouts
    monkeypatch.setattr(search_module, "search_layouts", lambda *a, **kw: pruned.append(kw["prune"]) or real(*a, **kw))
    args = _args(tmp_path, pp_degree="auto")
    choose([[37, 11, 8, 5]], SPEC, args, 1, 1, 2**30)
    choose([[37, 11, 8, 5], [90, 3]], SPEC, args, 1, 1, 2**30)
    assert pruned == [True, False, False]
