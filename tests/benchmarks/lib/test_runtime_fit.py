"""Fitting a profile to runtime rows (benchmarks/lib/runtime_fit.py) and measuring those rows
(benchmarks/lib/runtime_rows.py): known coefficients are recovered from synthetic rows, predictions
follow the cost model, and a tiny model's rows have the shapes the fitter needs."""
from __future__ import annotations

import copy

import pytest

from benchmarks.lib.runtime_fit import (
    fit_layer,
    fit_p2p,
    fit_runtime_profile,
    fit_working_memory,
    row_errors,
    row_segments,
    worst_error,
)
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.profile import TimeCoefficients

SPEC = ModelSpec("llama", 4, 256, 688, 8, 4, 32, 2048, False)
FWD = TimeCoefficients(2e-8, 4e-5, 2e-3)
BWD = TimeCoefficients(4e-8, 7e-5, 1.5e-3)
SHAPES = [[[0, 128]], [[0, 512]], [[0, 1024]], [[512, 1024]], [[1024, 1536]], [[0, 64]] * 4, [[0, 300], [0, 100]]]


def _layer_rows(level=None, context_pairs="band"):
    rows = []
    for segs in SHAPES:
        row = {"kind": "unit_layer", "segments": segs, "level": level}
        shape = UnitShape.of(row_segments(row), context_pairs)
        rows.append({**row, "fwd_s": FWD(shape.pairs, shape.tokens), "bwd_s": BWD(shape.pairs, shape.tokens),
                     "tokens": shape.tokens})
    return rows


def _loss_rows():
    head_f, head_b = TimeCoefficients(0, 2.5e-5, 1e-3), TimeCoefficients(0, 5e-5, 1e-3)
    return [{"kind": "unit_loss", "tokens": t, "fwd_s": head_f(0, t), "bwd_s": head_b(0, t) + head_f(0, t)}
            for t in (128, 512, 2048)]


def test_layer_fit_recovers_the_coefficients():
    rows = _layer_rows()
    for key, want in (("fwd_s", FWD), ("bwd_s", BWD)):
        got = fit_layer(rows, key)
        assert got.attn_pair_s == pytest.approx(want.attn_pair_s, rel=1e-6)
        assert got.token_s == pytest.approx(want.token_s, rel=1e-6)
        assert got.fixed_s == pytest.approx(want.fixed_s, rel=1e-6)
    with pytest.raises(ValueError, match=">= 3 unit_layer rows"):
        fit_layer(rows[:2], "fwd_s")


def test_layer_fit_counts_pairs_as_the_profiles_kernel_does():
    """Rows timed on a kernel that computes the masked rectangle: the band count misfits them, the
    rectangle count recovers the coefficients, and the fitted profile carries the count."""
    rows = _layer_rows(context_pairs="rectangle")
    got = fit_layer(rows, "fwd_s", "rectangle")
    assert got.attn_pair_s == pytest.approx(FWD.attn_pair_s, rel=1e-6)
    assert fit_layer(rows, "fwd_s").attn_pair_s != pytest.approx(FWD.attn_pair_s, rel=1e-3)
    profile = fit_runtime_profile(rows + _loss_rows(), SPEC, name="rect", context_pairs="rectangle")
    assert profile.context_pairs == "rectangle"
    assert profile.layer_backward.attn_pair_s == pytest.approx(BWD.attn_pair_s, rel=1e-6)


def test_profile_predicts_its_own_rows_and_checkpoint_levels_follow_the_cost_model():
    p2p = [{"kind": "p2p", "bytes": b, "seconds": 1e-4 + b / 1e9, "cpu_s": 2e-4 + b * 4e-10}
           for b in (65536, 1 << 20, 4 << 20)]
    memory = [{"kind": "unit_memory", "tokens": 100, "level": lv, "kept_bytes": 1000,
               "fwd_peak_bytes": 1000 + 100 * (2 * 1024 + f), "bwd_peak_bytes": 100 * (2 * 1024 + 700)}
              for lv, f in ((None, 10), ("full", 900), ("mlp", 800), ("mlp_act", 400))]
    rows = _layer_rows() + _loss_rows() + p2p + memory
    rows.append({"kind": "embedding", "tokens": 100, "fwd_s": 1e-5, "bwd_s": 3e-5})
    profile = fit_runtime_profile(rows, SPEC, name="synthetic", bytes_per_element=4, memory_gib=64.0)
    assert profile.memory_gib == 64.0 and profile.bytes_per_element == 4
    assert profile.p2p_latency_s == pytest.approx(1e-4, rel=1e-6)
    assert profile.p2p_bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    # The CPU a message costs both ends (gloo's threads), fitted beside its wall time.
    assert profile.p2p_cpu_s == pytest.approx(2e-4, rel=1e-6)
    assert profile.p2p_cpu_s_per_byte == pytest.approx(4e-10, rel=1e-6)
    assert profile.embedding_token_s == pytest.approx(2e-7)
    assert profile.layer_working_bytes_per_token == pytest.approx(10)
    assert profile.working_bytes_per_token == pytest.approx(
        {"backward": 700, "forward_full": 900, "forward_mlp": 800, "forward_mlp_act": 400})
    errors = row_errors(profile, SPEC, _layer_rows() + _loss_rows())
    assert worst_error(errors) < 1e-6
    # Level rows are predicted (recompute derived from the forward fit), not fitted: a backward
    # with a whole layer checkpointed costs its backward plus the cost model's replay.
    (full,) = row_errors(profile, SPEC, [{**_layer_rows()[1], "level": "full"}])
    assert full["bwd_predicted_s"] > BWD(512 * 512, 512) * 1.2
    assert full["fwd_predicted_s"] == pytest.approx(FWD(512 * 512, 512), rel=1e-6)


def test_p2p_and_working_memory_need_their_rows():
    with pytest.raises(ValueError, match="p2p rows"):
        fit_p2p([{"kind": "p2p", "bytes": 1, "seconds": 1.0}])
    with pytest.raises(ValueError, match="levels None, full, mlp and mlp_act"):
        fit_working_memory([{"kind": "unit_memory", "level": None, "tokens": 1, "kept_bytes": 0,
                             "fwd_peak_bytes": 0, "bwd_peak_bytes": 0}], 1024)


def test_tiny_model_rows_have_the_fitters_shapes():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from benchmarks.lib.runtime_rows import (
        UnitCase,
        measure_elementwise_rows,
        measure_embedding_rows,
        measure_loss_rows,
        measure_memory_rows,
        measure_unit_rows,
    )

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).float()
    cases = [UnitCase(((0, 16),)), UnitCase(((16, 40),)), UnitCase(((0, 8), (0, 12))), UnitCase(((0, 16),), "full")]
    rows = measure_unit_rows(copy.deepcopy(model), cases, repeat=1, warmup=0)
    assert [r["segments"] for r in rows] == [[[0, 16]], [[16, 40]], [[0, 8], [0, 12]], [[0, 16]]]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in rows) and rows[-1]["level"] == "full"
    loss = measure_loss_rows(copy.deepcopy(model), [8, 20], loss_chunk_tokens=8, repeat=1, warmup=0)
    assert [r["tokens"] for r in loss] == [8, 20] and all(r["bwd_s"] > 0 for r in loss)
    assert measure_embedding_rows(copy.deepcopy(model), [8], repeat=1, warmup=0)[0]["kind"] == "embedding"
    assert measure_elementwise_rows(copy.deepcopy(model), [8], repeat=1, warmup=0)[0]["bytes_per_s"] > 0
    mem = measure_memory_rows(copy.deepcopy(model), 16)
    assert [r["level"] for r in mem] == [None, "full", "mlp", "mlp_act"]
    # A whole-layer checkpoint keeps less than a layer that keeps everything.
    assert mem[1]["kept_bytes"] < mem[0]["kept_bytes"]
    with pytest.raises(ValueError, match="0 <= start < end"):
        UnitCase(((5, 5),))


def test_speed_factor_recovers_a_uniform_slowdown_and_rescale_compute_applies_it():
    from benchmarks.lib.runtime_fit import rescale_compute, speed_factor
    from infinipipe_hf.planner.cost.model import CostModel

    p2p = [{"kind": "p2p", "bytes": b, "seconds": 1e-4 + b / 1e9} for b in (65536, 1 << 20, 4 << 20)]
    profile = fit_runtime_profile(_layer_rows() + _loss_rows() + p2p, SPEC, name="synthetic", bytes_per_element=4)
    slower = [{**r, "fwd_s": 1.3 * r["fwd_s"], "bwd_s": 1.3 * r["bwd_s"]} for r in _layer_rows()]
    assert speed_factor(profile, SPEC, _layer_rows()) == pytest.approx(1.0, rel=1e-6)
    factor = speed_factor(profile, SPEC, slower)
    assert factor == pytest.approx(1.3, rel=1e-6)
    scaled = rescale_compute(profile, factor)
    assert worst_error(row_errors(scaled, SPEC, slower)) < 1e-6  # every kind of unit, not one shape
    assert scaled.meta["speed_factor"] == factor
    assert (scaled.p2p_bandwidth_bytes_per_s, scaled.p2p_latency_s) == (profile.p2p_bandwidth_bytes_per_s,
                                                                        profile.p2p_latency_s)
    assert scaled.elementwise_bytes_per_s == pytest.approx(profile.elementwise_bytes_per_s / 1.3)
    base, fast = (CostModel(SPEC, p, ParallelDims(pp_degree=2), layers_per_stage=[2, 2]) for p in (profile, scaled))
    shape = UnitShape.of(row_segments({"segments": [[512, 1024]]}))
    for stage in (0, 1):
        assert fast.compute.forward_time(stage, shape) == pytest.approx(1.3 * base.compute.forward_time(stage, shape),
                                                                rel=1e-9)
        assert fast.backward_time(stage, shape, 1) == pytest.approx(1.3 * base.backward_time(stage, shape, 1),
                                                                    rel=1e-9)
    # One factor cannot absorb a shape error: rows slowed unevenly leave a residual.
    uneven = [{**r, "fwd_s": r["fwd_s"] * (1.0 + 0.5 * (i % 2))} for i, r in enumerate(_layer_rows())]
    assert worst_error(row_errors(rescale_compute(profile, speed_factor(profile, SPEC, uneven)), SPEC, uneven)) > 0.1
    with pytest.raises(ValueError, match="factor > 0"):
        rescale_compute(profile, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        speed_factor(profile, SPEC, p2p)


def test_worst_error_can_skip_rows_too_short_to_matter_and_names_the_worst_row():
    from benchmarks.lib.runtime_fit import worst_row

    errors = [{"kind": "embedding", "tokens": 128, "fwd_measured_s": 3e-5, "fwd_ratio": 3.0,
               "bwd_measured_s": 3e-5, "bwd_ratio": 1.0},
              {"kind": "unit_layer", "segments": [[0, 512]], "fwd_measured_s": 0.015, "fwd_ratio": 1.1,
               "bwd_measured_s": 0.03, "bwd_ratio": 0.95}]
    assert worst_error(errors) == 2.0
    assert abs(worst_error(errors, 1e-3) - 0.1) < 1e-12
    assert worst_row(errors).startswith("embedding 128 fwd")
