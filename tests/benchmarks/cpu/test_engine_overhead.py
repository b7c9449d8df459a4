"""benchmarks/cpu/engine_overhead.py: the runner path and the layers-only path run the same units
(every action of a step in both), the share arithmetic, and a short run writing its report."""
import json

import pytest
import torch

from benchmarks.cpu import engine_overhead as eo

SMALL = {**eo.MODEL, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64}
UNITS = (("whole", ((0, 0, 24),)), ("pack", ((3, 0, 8), (4, 0, 8))), ("slice", ((2, 0, 16),)),
         ("slice", ((2, 16, 32),)), ("hybrid", ((2, 32, 40), (1, 0, 8), (5, 0, 8))))
LENGTHS = [24, 8, 40, 8, 8, 8]


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(eo, "MODEL", SMALL)
    monkeypatch.setattr(eo, "UNITS", UNITS)
    monkeypatch.setattr(eo, "LENGTHS", LENGTHS)


def test_shares_are_the_runner_time_over_the_layers_time_per_kind_and_step():
    plan = eo.step_plan(2)
    runner = {str(a): 1.1 for a in plan.stage_actions(0, 1)}
    layers = {str(a): 1.0 for a in plan.stage_actions(0, 1)}
    runner["F0"] = 1.5  # the whole sequence's forward: (1.5 + 1.1 - 2) / 2
    got = eo.shares(runner, layers, plan)
    assert set(got) == {"whole", "pack", "slice", "hybrid", "step"}
    assert got["whole"] == pytest.approx(0.3) and got["slice"] == pytest.approx(0.1)
    assert got["step"] == pytest.approx((0.4 + 0.1 * 10) / 10)


def test_both_paths_run_every_action_and_compute_the_same_layers(small):
    torch.set_num_threads(1)
    run = eo.OverheadRun(2, cache_sequences=True)
    labels = [str(a) for a in run.plan.stage_actions(0, 1)]
    lay, got = run.layers_only(), run.through_runner()
    assert list(lay) == list(got) == labels and all(t > 0 for t in lay.values())
    # the layers-only path is the runner's stage on the same inputs: same forward output
    r = run.runner
    r.begin_step(run.plan, run.batch, run.labels)
    out = r.forward(0, run.xs[0])
    from infinipipe_hf.runtime.recompute.layers import run_decoder_layers

    t = r.unit_tensors(0)
    cos_sin = r.stage.hf_model.model.rotary_emb(run.xs[0], position_ids=t.position_ids)
    with torch.no_grad():
        direct = run_decoder_layers(r.stage.decoder_layers(), run.xs[0], num_checkpointed=0,
                                    position_ids=t.position_ids, position_embeddings=cos_sin, unit_ctx=r._context(t))
    assert torch.equal(out, direct)
    r.backward(0, run.grads[0])
    r.kv_store.clear()
    r._pending.clear()
    r.end_step()


def test_a_short_run_writes_both_modes(small, tmp_path):
    out = tmp_path / "o.json"
    assert eo.main(["--layers", "1", "--repeat", "1", "--warmup", "0", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["modes"]) == {"cached", "per_unit"} and len(rep["load_average_before"]) == 3
    for m in rep["modes"].values():
        assert set(m["median_share"]) == {"whole", "pack", "slice", "hybrid", "step"}
        assert m["worst_share"]["step"] >= m["median_share"]["step"] and m["step_layers_s"] > 0
        assert set(m["fastest_share"]) == set(m["median_share"])
    with pytest.raises(SystemExit):
        eo.main(["--layers", "0", "--out", str(out)])
