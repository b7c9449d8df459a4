"""``ring-cp-packed``: packed THD ring CP beside unpacked ``ring-cp``."""
from dataclasses import replace

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.search.api import plan_alternative

SPEC = ModelSpec.from_json_file(config_path("llama3-8b"))
_CAL = default_profile().calibration
NEUTRAL = replace(default_profile(), calibration=replace(_CAL, system_efficiency={}))
"""The shipped profile with both ring systems at one whole-step efficiency (the shipped one prices
torchtitan's and Megatron's apart), so the mechanisms compare alone."""


def plan(schedule, lengths, **knobs):
    return plan_alternative(lengths, SPEC, schedule, world_size=8, memory_budget_bytes=80 * GIB, profile=NEUTRAL,
                            **knobs).summary()


def test_one_document_costs_what_unpacked_ring_cp_costs():
    a = plan("ring-cp", [32768], cp_degrees=[4], checkpointing=8)
    b = plan("ring-cp-packed", [32768], cp_degrees=[4], checkpointing=8)
    assert b["step_time_s"] == pytest.approx(a["step_time_s"], rel=1e-12)


def test_packing_short_documents_beats_one_round_per_document():
    lengths = [1024] * 48 + [16384]
    packed, unpacked = plan("ring-cp-packed", lengths), plan("ring-cp", lengths)
    assert packed["feasible"] and packed["tokens_per_s"] > 2 * unpacked["tokens_per_s"]
    assert packed["info"]["attention"] == "ring-packed" and "pack_tokens" in packed["info"]


def test_packed_pairs_are_per_document_squares():
    group = FlatCost.of(SPEC, 8, 80 * GIB).group("ring-packed", 2)
    assert group.micro_batch_pairs([100, 200], 304) == 100 ** 2 + 200 ** 2 + 4 ** 2
    with pytest.raises(ValueError, match="cp_degree=3 is not possible"):
        plan("ring-cp-packed", [1024], cp_degrees=[3])
