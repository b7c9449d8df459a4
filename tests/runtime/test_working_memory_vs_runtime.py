"""The phase model of working memory against the runtime's allocator peaks (CPU, float32).

Design: the profile's working-memory figures are measured the way ``benchmarks/cpu/cpu_profile.py``
measures them, on a *one-layer* stage running one whole sequence at each checkpoint level
(``measure_memory_rows``, decomposed by ``fit_working_memory``).  The model is then checked on
what it never saw: a 3-layer first stage and a last stage with the chunked loss, whole units,
slices carrying context (their K/V copies and SDPA mask) and packs, at mixes of levels across the
layers.  Measured: the allocator's peak while the unit's forward runs (``MemoryProbe``, above the
level before it: everything the unit allocates, kept or transient) and, for its backward, what
the forward kept plus the backward's peak above that (weight gradients allocated beforehand: they
are model states, counted with the weights; the KV store's gradients of a slice's context, which
the model counts in its KV store term, are added to the prediction).  Predicted: what the unit keeps
(``LevelCosts.unit_activation_bytes``) plus ``WorkingMemory.excess``.  The linear bound the model
used before (``StageActivations.working_bytes``) is checked to be off by more than the tolerance on the
units checkpointed whole, so the test can tell the two apart.
"""
from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from benchmarks.lib.runtime_fit import fit_working_memory, reference_of  # noqa: E402
from benchmarks.lib.runtime_rows import _allocate_grads, measure_memory_rows  # noqa: E402
from infinipipe_hf.ir.actions import Action  # noqa: E402
from infinipipe_hf.ir.levels import CheckpointMix  # noqa: E402
from infinipipe_hf.ir.model_spec import ModelSpec  # noqa: E402
from infinipipe_hf.ir.plan import Plan  # noqa: E402
from infinipipe_hf.ir.units import Segment, Unit  # noqa: E402
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.activations import act_elements  # noqa: E402
from infinipipe_hf.planner.cost.model import CostModel  # noqa: E402
from infinipipe_hf.planner.cost.profile import default_profile  # noqa: E402
from infinipipe_hf.profiling.memory_events import MemoryProbe  # noqa: E402
from infinipipe_hf.runtime.stage.module import build_stage  # noqa: E402
from infinipipe_hf.runtime.stage.runner import StageRunner  # noqa: E402

SPLIT = [3, 1]
T = 512
VOCAB = 512
CHUNK = 256
HIDDEN = 256


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=688,
                                   num_hidden_layers=sum(SPLIT), num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def fitted():
    torch.set_num_threads(1)
    model = _model()
    spec = ModelSpec.from_hf_config(model.config)
    rows = measure_memory_rows(copy.deepcopy(model), T)
    lw, working = fit_working_memory(rows, HIDDEN * 4)
    profile = dataclasses.replace(
        default_profile(), name="fp32-working", reference=reference_of(spec), bytes_per_element=4,
        activation_bytes_per_token_per_layer=act_elements(HIDDEN, 688, spec.kv_dim, 4) * 4.0,
        attention_mask_bytes_per_element=4.0, layer_working_bytes_per_token=lw, working_bytes_per_token=working)
    cost = CostModel(spec, profile, ParallelDims(pp_degree=2), layers_per_stage=SPLIT, loss_chunk_tokens=CHUNK)
    linear = CostModel(spec, dataclasses.replace(profile, working_bytes_per_token={}), ParallelDims(pp_degree=2), layers_per_stage=SPLIT, loss_chunk_tokens=CHUNK)
    return model, cost, linear


def _measure(model, stage_index, lengths, units, measured, mix: CheckpointMix):
    # Python's cycle collector runs when its allocation counters say so, which depends on every
    # test run before this one in the process; a collection inside a probe frees tensors early
    # and moved one backward peak by 2 MiB in a full-suite run.  Collect first, then keep it off.
    gc.collect()
    gc.disable()
    try:
        return _measure_unit(model, stage_index, lengths, units, measured, mix)
    finally:
        gc.enable()


def _measure_unit(model, stage_index, lengths, units, measured, mix: CheckpointMix):
    m = copy.deepcopy(model)
    lo = sum(SPLIT[:stage_index])
    runner = StageRunner(build_stage(m, stage_index, range(lo, lo + SPLIT[stage_index])), loss_chunk_tokens=CHUNK)
    acts = [Action("F", u.id) for u in units] + [Action("B", u.id) for u in reversed(units)]
    stages = [[], []]
    stages[stage_index] = acts
    plan = Plan("epp", 2, 1, lengths, units, {0: stages}, {stage_index: {measured: mix.full}}, list(SPLIT),
                checkpoint_levels={stage_index: {measured: mix.finer}} if mix.finer else {})
    g = torch.Generator().manual_seed(1)
    batch = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    runner.begin_step(plan, batch, sum(n - 1 for n in lengths))
    hidden = {u.id: None if stage_index == 0 else torch.randn(1, u.num_tokens, HIDDEN, generator=g) for u in units}
    grads = {u.id: None if stage_index == 1 else torch.randn(1, u.num_tokens, HIDDEN, generator=g) for u in units}
    for u in units:
        if u.id == measured:
            with MemoryProbe() as fwd:
                runner.forward(u.id, hidden[u.id])
        else:
            runner.forward(u.id, hidden[u.id])
    _allocate_grads(runner.stage)  # weight gradients are model states, not the unit's working memory
    for u in reversed(units):
        if u.id == measured:
            with MemoryProbe() as bwd:
                out = runner.backward(u.id, grads[u.id])
            del out
        else:
            runner.backward(u.id, grads[u.id])
    runner.end_step()
    return fwd.trace.peak_bytes, fwd.trace.final_bytes + bwd.trace.peak_bytes


WHOLE = ([T], [Unit(0, (Segment(0, 0, T),))], 0)
CONTEXT = ([2 * T], [Unit(0, (Segment(0, 0, T),)), Unit(1, (Segment(0, T, 2 * T),))], 1)
PACKED = ([200, 180, 132], [Unit(0, (Segment(0, 0, 200), Segment(1, 0, 180), Segment(2, 0, 132)))], 0)
CASES = [
    ("whole", 0, WHOLE, (0, 0, 0)), ("whole", 0, WHOLE, (3, 0, 0)), ("whole", 0, WHOLE, (1, 1, 1)),
    ("whole", 0, WHOLE, (0, 3, 0)), ("whole", 0, WHOLE, (0, 0, 3)), ("whole", 0, WHOLE, (2, 0, 1)),
    ("context", 0, CONTEXT, (0, 0, 0)), ("context", 0, CONTEXT, (3, 0, 0)), ("context", 0, CONTEXT, (1, 2, 0)),
    ("packed", 0, PACKED, (1, 0, 2)),
    ("whole", 1, WHOLE, (0, 0, 0)), ("whole", 1, WHOLE, (1, 0, 0)), ("context", 1, CONTEXT, (1, 0, 0)),
]


@pytest.mark.parametrize("what,stage,case,mix", CASES,
                         ids=[f"{w}-stage{s}-full{m[0]}-mlp{m[1]}-act{m[2]}" for w, s, _, m in CASES])
def test_unit_peaks_match_the_phase_model(fitted, what, stage, case, mix):
    model, cost, linear = fitted
    lengths, units, measured = case
    m = CheckpointMix(*mix) if stage == 0 else CheckpointMix(*mix[:1])
    fwd, bwd = _measure(model, stage, lengths, units, measured, m)
    segs = next(u for u in units if u.id == measured).segments
    kept = cost.levels.unit_activation_bytes(stage, segs, m)
    want_f = kept + cost.working.excess(stage, segs, m, backward=False)
    want_b = kept + cost.working.excess(stage, segs, m, backward=True)
    context = sum(s.start for s in segs)
    if context:
        # The backward also fills the KV store's gradients of the context; the model counts them
        # (with the K/V themselves) in the stage's KV store term, not in the unit's working memory.
        want_b += cost.acts.kv_bytes(stage, context) / 2
    print(f"{what} stage {stage} {m}: forward measured {fwd / 2**20:.2f} MiB, model {want_f / 2**20:.2f} "
          f"({fwd / want_f:.3f}); backward measured {bwd / 2**20:.2f} MiB, model {want_b / 2**20:.2f} ({bwd / want_b:.3f})")
    assert abs(fwd / want_f - 1) <= 0.10, (fwd, want_f)
    assert abs(bwd / want_b - 1) <= 0.10, (bwd, want_b)
    # The bound the solver uses is never below the exact phases.
    tokens = sum(s.end - s.start for s in segs)
    ctx = cost.acts.context_bytes_per_layer(segs)
    for backward in (False, True):
        assert cost.working.excess(stage, segs, m, backward) <= cost.working.bound(stage, tokens, ctx, backward) + 1e-6
    if stage == 0 and m.full == SPLIT[0]:
        # Units checkpointed whole: the linear bound charges two layers' activations in backward.
        old = kept + linear.acts.working_bytes(stage, tokens, m.full, backward=True)
        assert old > 1.10 * bwd, (old, bwd)
