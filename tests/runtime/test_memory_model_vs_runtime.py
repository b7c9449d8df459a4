"""The planner's activation model against what the real runtime saves for backward (CPU, float32).

Design: one small Llama-shaped model (hidden 256, intermediate 688, 8 heads, 4 KV heads) is cut
into stages with ``build_stage`` and run through ``StageRunner.forward`` exactly as a pipeline
does.  While one unit's forward runs, ``saved_tensors_hooks`` record every tensor autograd saves;
distinct *storages* are counted once (a view, or the same tensor saved by two ops, is one buffer),
parameters are excluded (model states, not activations).  Non-reentrant checkpointing hides the
tensors saved inside a checkpointed layer behind its own hooks and keeps the layer's *inputs*
alive in its frame, so the checkpoint call is wrapped to count those inputs too: that is what a
checkpointed layer really keeps.

Prediction: ``StageActivations.activation_bytes`` with a float32 profile whose per-token figure is what
the cost model's formula gives in float32 (``_act_elements(reference, 4) * 4``,
``bytes_per_element=4``), so the check is of the *formula* against the runtime, not of one measured
number against itself.  (The formula's bf16 form, ``10 * hidden`` for the attention side, counts
the float32 copies RMSNorm keeps in bf16; in float32 they are the input itself: ``8 * hidden``.)

Slices with context: the attention concatenates the context K/V with the slice's own, and the
SDPA backend turns the boolean lower-right mask into a float mask; autograd keeps both:
``bpe * (2 * C * kv_dim) + mask_bpe * s * (C + s)`` extra bytes per non-checkpointed layer
(segment of ``s`` tokens with ``C`` of context; GQA heads are not repeated, ``enable_gqa``).
``StageActivations.context_bytes_per_layer`` is that term; the test checks the model with it, and that
without it a slice behind context is under-predicted.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from infinipipe_hf.ir.actions import Action  # noqa: E402
from infinipipe_hf.ir.levels import CheckpointMix  # noqa: E402
from infinipipe_hf.ir.model_spec import ModelSpec  # noqa: E402
from infinipipe_hf.ir.plan import Plan  # noqa: E402
from infinipipe_hf.ir.units import Segment, Unit  # noqa: E402
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.activations import _act_elements  # noqa: E402
from infinipipe_hf.planner.cost.model import CostModel  # noqa: E402
from infinipipe_hf.planner.cost.profile import default_profile, reference_spec  # noqa: E402
from infinipipe_hf.runtime.recompute import layers as checkpointing  # noqa: E402
from infinipipe_hf.runtime.recompute import mlp_levels
from infinipipe_hf.runtime.stage.module import build_stage  # noqa: E402
from infinipipe_hf.runtime.stage.runner import StageRunner  # noqa: E402

NUM_LAYERS = 4
SPLIT = [3, 1]  # stage 0: layers 0-2 (embeddings), stage 1: layer 3 + norm + head + loss
T = 512  # tokens per unit
VOCAB = 512


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=NUM_LAYERS, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).float()


def _cost(spec: ModelSpec) -> CostModel:
    ref = reference_spec(default_profile())
    fp32 = dataclasses.replace(default_profile(), name="fp32-formula", bytes_per_element=4,
                               activation_bytes_per_token_per_layer=_act_elements(ref, 4) * 4.0)
    return CostModel(spec, fp32, ParallelDims(pp_degree=2), layers_per_stage=SPLIT)


def _key(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedBytes:
    """Distinct storages saved for backward (plus checkpoint inputs) while a block runs."""

    def __init__(self, exclude):
        self.skip = {_key(p) for p in exclude}
        self.seen: dict = {}

    def _add(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and _key(t) not in self.skip:
            self.seen[_key(t)] = _key(t)[1]

    def run(self, fn, monkeypatch):
        real = checkpointing.checkpoint

        def counting(f, *args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in (a if isinstance(a, tuple) else (a,)):
                    self._add(t)
            return real(f, *args, **kwargs)

        stores = []

        def counting_with_stores(f, *args, **kwargs):
            # keep_attn layers keep the attention output and log-sum-exp outside autograd's
            # saved tensors, in the unit's store: count what it holds after the forward.
            store = getattr(kwargs.get("epp_unit"), "kept_attention", None)
            if store is not None and all(store is not s for s in stores):
                stores.append(store)
            return counting(f, *args, **kwargs)

        # Whole layers and the levels inside layers all checkpoint through these names.
        monkeypatch.setattr(checkpointing, "checkpoint", counting_with_stores)
        monkeypatch.setattr(mlp_levels, "checkpoint", counting)

        def pack(t):
            self._add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        for store in stores:
            for t in store.tensors():
                self._add(t)
        for module in (checkpointing, mlp_levels):
            monkeypatch.setattr(module, "checkpoint", real)
        return out, int(sum(self.seen.values()))


def _runner(stage_index: int):
    model = _model()
    spec = ModelSpec.from_hf_config(model.config)
    lo = sum(SPLIT[:stage_index])
    stage = build_stage(model, stage_index, range(lo, lo + SPLIT[stage_index]))
    return StageRunner(stage, loss_chunk_tokens=128), spec


def _plan(lengths, units, ckpt: dict[int, dict[int, int]], levels=None):
    acts = [Action("F", u.id) for u in units] + [Action("B", u.id) for u in reversed(units)]
    return Plan("epp", 2, 1, lengths, units, {0: [acts, list(acts)]}, ckpt, list(SPLIT),
                checkpoint_levels=levels or {})


def _measure(stage_index, lengths, units, ckpt, measured_unit, monkeypatch, levels=None):
    runner, spec = _runner(stage_index)
    ids = torch.Generator().manual_seed(1)
    batch = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=ids).tolist()} for n in lengths]
    runner.begin_step(_plan(lengths, units, ckpt, levels), batch, sum(n - 1 for n in lengths))
    hidden = 256
    got = None
    for u in units:
        x = None if stage_index == 0 else torch.randn(1, u.num_tokens, hidden)
        if u.id == measured_unit:
            probe = SavedBytes(runner.stage.parameters())
            _, got = probe.run(lambda: runner.forward(u.id, x), monkeypatch)
        else:
            runner.forward(u.id, x)
    return got, _cost(spec), spec


def _ratio(measured, predicted):
    return measured / predicted


@pytest.mark.parametrize("checkpointed", [0, 2, 3])
def test_first_stage_units_match_the_model(checkpointed, monkeypatch):
    units = [Unit(0, (Segment(0, 0, T),))]
    got, cost, _ = _measure(0, [T], units, {0: {0: checkpointed}}, 0, monkeypatch)
    want = cost.acts.activation_bytes(0, T, checkpointed)
    print(f"stage 0, {checkpointed}/3 checkpointed: measured {got} B, model {want:.0f} B, "
          f"ratio {_ratio(got, want):.3f}")
    assert abs(_ratio(got, want) - 1) <= 0.10, (got, want)


def test_last_stage_with_chunked_loss_matches_the_model(monkeypatch):
    units = [Unit(0, (Segment(0, 0, T),))]
    got, cost, _ = _measure(1, [T], units, {}, 0, monkeypatch)
    want = cost.acts.activation_bytes(1, T, 0)
    print(f"last stage: measured {got} B, model {want:.0f} B, ratio {_ratio(got, want):.3f}")
    assert abs(_ratio(got, want) - 1) <= 0.10, (got, want)


def test_packed_unit_matches_the_model(monkeypatch):
    """Several whole sequences in one unit: no context, the same bytes per token."""
    lengths = [200, 180, 132]
    units = [Unit(0, tuple(Segment(i, 0, n) for i, n in enumerate(lengths)))]
    got, cost, _ = _measure(0, lengths, units, {}, 0, monkeypatch)
    want = cost.acts.activation_bytes(0, T, 0)
    print(f"packed unit: measured {got} B, model {want:.0f} B, ratio {_ratio(got, want):.3f}")
    assert abs(_ratio(got, want) - 1) <= 0.10, (got, want)


@pytest.mark.parametrize("checkpointed", [0, 2, 3])
def test_slice_with_context_matches_the_model(checkpointed, monkeypatch):
    """Second slice of a 1024-token sequence: the attention keeps the concatenated context K/V and,
    on the SDPA backend, a dense mask; the model counts both (``context_bytes_per_layer``)."""
    c, s = T, T
    units = [Unit(0, (Segment(0, 0, c),)), Unit(1, (Segment(0, c, c + s),))]
    got, cost, spec = _measure(0, [c + s], units, {0: {0: 0, 1: checkpointed}}, 1, monkeypatch)
    cost = CostModel(spec, dataclasses.replace(cost.profile, attention_mask_bytes_per_element=4.0), ParallelDims(pp_degree=2), layers_per_stage=SPLIT)
    want = cost.acts.unit_activation_bytes(0, units[1].segments, checkpointed)
    plain = cost.acts.activation_bytes(0, s, checkpointed)
    print(f"slice with context, {checkpointed}/3 checkpointed: measured {got} B, model {want:.0f} B "
          f"(ratio {_ratio(got, want):.3f}); without the context term {plain:.0f} B")
    assert abs(_ratio(got, want) - 1) <= 0.10, (got, want)
    if checkpointed < SPLIT[0]:
        # The context term is what closes the gap: without it the model is off by more than 10%.
        assert _ratio(got, plain) > 1.10


# Layers of 3 at whole, mlp, mlp_act (and keep_attn) levels.
MIXES = [(0, 3, 0), (0, 0, 3), (1, 1, 1), (0, 1, 2), (2, 0, 1), (0, 0, 0, 3), (1, 0, 1, 1)]


def _mix_id(m):
    return f"full{m[0]}-mlp{m[1]}-act{m[2]}" + (f"-keep{m[3]}" if len(m) > 3 else "")


@pytest.mark.parametrize("mix", MIXES, ids=_mix_id)
def test_checkpoint_levels_match_the_model(mix, monkeypatch):
    """Each level inside a layer keeps what the model says: the saved bytes of a unit whose layers
    run at whole / MLP / act*mul levels against ``LevelCosts.unit_activation_bytes``."""
    m = CheckpointMix(*mix)
    units = [Unit(0, (Segment(0, 0, T),))]
    got, cost, _ = _measure(0, [T], units, {0: {0: m.full}}, 0, monkeypatch, levels={0: {0: m.finer}})
    want = cost.levels.unit_activation_bytes(0, units[0].segments, m)
    whole_only = cost.acts.activation_bytes(0, T, m.full)
    print(f"levels {m}: measured {got} B, model {want:.0f} B, ratio {_ratio(got, want):.3f}; "
          f"whole layers alone {whole_only:.0f} B")
    assert abs(_ratio(got, want) - 1) <= 0.10, (got, want)
    # The finer levels really drop bytes (more than the 10% tolerance): the test can tell them apart.
    assert whole_only - want > 0.10 * want
    if m.keep_attn == m.total:
        # ... and keep_attn really keeps more than whole layers would.
        as_full = cost.acts.activation_bytes(0, T, m.full + m.keep_attn) - cost.levels.finer_saved_bytes(
            0, units[0].segments, CheckpointMix(0, m.mlp, m.mlp_act))
        assert want - as_full > 0.10 * want and abs(_ratio(got, as_full) - 1) > 0.10


@pytest.mark.parametrize("mix", [(0, 3, 0), (1, 0, 2), (0, 0, 0, 3), (0, 1, 0, 2)], ids=_mix_id)
def test_checkpoint_levels_on_a_slice_with_context(mix, monkeypatch):
    """The MLP levels keep the attention, so the context K/V copies (and SDPA mask) stay per
    layer; keep_attn keeps neither (its attention backward runs from what it keeps)."""
    m = CheckpointMix(*mix)
    c, s = T, T
    units = [Unit(0, (Segment(0, 0, c),)), Unit(1, (Segment(0, c, c + s),))]
    got, cost, spec = _measure(0, [c + s], units, {0: {0: 0, 1: m.full}}, 1, monkeypatch,
                               levels={0: {1: m.finer}})
    cost = CostModel(spec, dataclasses.replace(cost.profile, attention_mask_bytes_per_element=4.0), ParallelDims(pp_degree=2), layers_per_stage=SPLIT)
    want = cost.levels.unit_activation_bytes(0, units[1].segments, m)
    print(f"slice with context, levels {m}: measured {got} B, model {want:.0f} B, ratio {_ratio(got, want):.3f}")
    assert abs(_ratio(got, want) - 1) <= 0.10, (got, want)


def test_default_profile_still_gives_the_h100_figure():
    """The shipped bf16 profile on the Llama-3-8B shape: ~196 KiB per token per layer."""
    spec = ModelSpec("llama", 32, 4096, 14336, 32, 8, 128, 128256, False)
    cost = CostModel(spec, dims=ParallelDims(pp_degree=1))
    assert 190 * 1024 <= cost.acts.act_bytes_per_token <= 200 * 1024, cost.acts.act_bytes_per_token
