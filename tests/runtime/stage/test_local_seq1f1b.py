"""seq1f1b's equal-compute slices, run by the one-process pipeline, against the unsplit HF model in float64.

The slices come from the planner's cutter (``equal_compute_slices``) with a large pair weight, so
they are clearly unequal (later ones shorter) and a packed micro-batch's slices cross document
boundaries; the actions are the schedule's (1F1B, later slices backward first, EPP's warm-up).
"""
import pytest

from infinipipe_hf.ir.partition import partition_layers
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.uniform import equal_compute_slices, pack_sequences
from infinipipe_hf.planner.pipeline.actions import backward_order, build_pipeline_actions, epp_warmup
from infinipipe_hf.planner.validate.validator import validate
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, check
from tests.helpers.reference import random_batch, tiny_model


def _seq1f1b_plan(pp: int, k: int = 3) -> Plan:
    units = []
    for b in pack_sequences(LENGTHS, 32):  # [29, 3] and [9, 6, 4]
        for segs in equal_compute_slices([(s, LENGTHS[s]) for s in b], k, pair_weight=0.5):
            units.append(Unit(len(units), tuple(segs)))
    acts = build_pipeline_actions([u.id for u in units], backward_order(units, LENGTHS), epp_warmup(ParallelDims(pp), k))
    layers = [len(x) for x in partition_layers(NUM_LAYERS, pp)]
    ck = {s: {u.id: (u.id + s) % (layers[s] + 1) for u in units} for s in range(pp)}
    return Plan("seq1f1b", pp, 1, list(LENGTHS), units, {0: acts}, ck, layers_per_stage=layers)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_equal_compute_slices_match_the_unsplit_model(pp):
    plan = _seq1f1b_plan(pp)
    sizes = [s.length for u in plan.units for s in u.segments if s.seq == 0]
    assert len(sizes) == 3 and sizes[0] > sizes[1] > sizes[2]  # the 29-token sequence: later slices shorter
    assert any(len(u.segments) > 1 and u.segments[0].start > 0 for u in plan.units)  # a slice crosses documents
    validate(plan, None)
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=3)
    check(model, build_stages(model, pp), plan, random_batch(LENGTHS, seed=3))
