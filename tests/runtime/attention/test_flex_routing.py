"""The engine routes each unit kind to the backend its profile's measured table ranks first, and
stays exact: a whole sequence, a slice with context, a hybrid and a pack through one training step
against the unsplit model, each attention call seen by the backend of its unit kind."""
import dataclasses

import pytest

from infinipipe_hf import InfiniPipeConfig, PipelineEngine
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.runtime.attention import select as attn
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import RoutedBackend
from infinipipe_hf.runtime.attention.types import unit_kind
from tests.distributed.plans import make_plan
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model

LENGTHS = [19, 7, 5, 6]
UNITS = [[[(0, 0, 8)], [(0, 8, 14)], [(0, 14, 19), (2, 0, 5)], [(1, 0, 7), (3, 0, 6)]]]


def test_engine_routes_unit_kinds_by_the_measured_table(monkeypatch, tmp_path):
    calls = []

    def recording(name):
        def backend(a):
            calls.append((name, unit_kind(a)))
            return sdpa_backend(a)
        return backend

    for name in ("fast_pack", "fast_context"):
        monkeypatch.setitem(attn._BACKENDS, name, (recording(name), lambda d: True))
    table = {"ranking": {"packed": ["fast_pack", "sdpa"], "slice": ["flex", "fast_context"],
                         "hybrid": ["fast_context"], "sequence": ["sdpa"]}}
    path = tmp_path / "profile.json"
    dataclasses.replace(default_profile(), attention_backends=table).save(path)

    batch = random_batch(LENGTHS, seed=5, with_labels=True)
    want_loss, want = reference_loss_and_grads(tiny_model("llama", num_layers=2, seed=5), batch)
    engine = PipelineEngine(tiny_model("llama", num_layers=2, seed=5), InfiniPipeConfig(profile=str(path)),
                            planner=lambda lens, eng: make_plan(lens, UNITS, 1, eng.layers_per_stage))
    assert isinstance(engine.runner.backend, RoutedBackend)
    assert engine.runner.backend.routes == {"sequence": "sdpa", "packed": "fast_pack", "slice": "fast_context",
                                            "hybrid": "fast_context"}
    out = engine.train_step(batch)
    assert out.loss == pytest.approx(want_loss, rel=1e-12)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)
    # two layers per unit: the slice, the hybrid and the pack each went to their kind's backend
    assert sorted(set(calls)) == [("fast_context", "hybrid"), ("fast_context", "slice"), ("fast_pack", "packed")]
    assert len(calls) == 3 * 2

    named = PipelineEngine(tiny_model("llama", num_layers=2, seed=5),
                           InfiniPipeConfig(profile=str(path), attention_backend="sdpa"))
    assert named.runner.backend is sdpa_backend  # a backend asked for by name ignores the table
