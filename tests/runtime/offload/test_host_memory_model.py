"""The planner's host-memory model (``planner/checkpointing/host_peak.py``, ``cost.host``) against
the runtime host tier's own accounting, on CPU: a float64 model (the cost model priced at 8 bytes
per element) runs a sliced, hybrid and packed plan with ``offload``, ``offload_attn`` or ``offload_pair``
layers (a unit's one layer at ``offload_pair`` keeps its input: an odd run) and/or ``offload_kv``
through the stage runners, and each stage's ``HostTier`` peak is within 5% of the predicted host
peak of that stage."""
import dataclasses

import pytest

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.host_peak import host_peak_bytes_per_stage
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.runtime.stage.local import _run_replica
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, make_plan
from tests.helpers.reference import random_batch, tiny_model


def measured_peaks(model, plan, batch) -> list[int]:
    runners = [StageRunner(st, loss_chunk_tokens=8) for st in build_stages(model, plan.pp_degree)]
    for r in runners:
        r.begin_step(plan, batch, label_token_count(batch))
        r.kv_store.offload = r.stage.stage_index in plan.offload_kv
        r.kv_store.host_tier.reset_stats()
    _run_replica(runners, plan, 0)
    peaks = [r.kv_store.host_tier.peak_bytes for r in runners]
    for r in runners:
        r.end_step()
    return peaks


def predicted_peaks(model, plan) -> list[float]:
    profile = dataclasses.replace(default_profile(), bytes_per_element=8)
    cost = CostModel(ModelSpec.from_hf_config(model.config), profile, ParallelDims(pp_degree=plan.pp_degree),
                     layers_per_stage=plan.layers_per_stage, host_budget_bytes=2.0**40)
    return host_peak_bytes_per_stage(plan, cost)


@pytest.mark.parametrize("offload_layers, offload_kv, level", [(True, [], "offload"), (False, [0, 1], "offload"),
                                                               (True, [1], "offload"), (True, [], "offload_attn"),
                                                               (True, [1], "offload_attn"), (True, [], "offload_pair"),
                                                               (True, [1], "offload_pair")])
def test_host_peak_predicted_within_five_percent(offload_layers, offload_kv, level):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=40)
    batch = random_batch(LENGTHS, seed=40)
    plan = make_plan(2, "1f1b", "none")
    if offload_layers:  # units offload none, one or both layers of a stage
        for s in range(2):
            for u in plan.units:
                m = CheckpointMix(**{level: (s + u.id) % 3})
                if m.total:
                    plan.checkpoint_levels.setdefault(s, {})[u.id] = m.finer
    plan.offload_kv = list(offload_kv)
    got, want = measured_peaks(model, plan, batch), predicted_peaks(model, plan)
    for s, (g, w) in enumerate(zip(got, want)):
        assert g > 0 and w > 0, (s, got, want)
        print(f"stage {s}: measured {g} B, predicted {w:.0f} B")
        assert abs(g - w) <= 0.05 * w, f"stage {s}: measured host peak {g} B, predicted {w:.0f} B"
