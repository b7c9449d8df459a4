"""Hand-built plans run by one process against the unsplit HF model, for the runtime tests.

``make_plan`` cuts a long sequence into unequal slices (its tail packed with a short sequence)
and packs the rest, under GPipe-like or 1F1B-like orders and with none / some / all layers
checkpointed; ``with_levels`` gives such a plan mixes of checkpoint levels; ``check`` runs it and
compares the loss and every gradient with the reference.
"""
import copy
import warnings

import pytest

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.partition import partition_layers
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.stage.local import run_plan_locally
from infinipipe_hf.runtime.stage.module import build_stage
from tests.helpers.reference import assert_grads_close, reference_loss_and_grads

LENGTHS = [29, 6, 9, 4, 3]
NUM_LAYERS = 4


def mixed_units(dp_rank=0, first_id=0, seq_offset=0):
    """Seq 0 cut at 7 and 18 (3 unequal slices; tail packed with seq 1), seqs 2-4 packed."""
    s = seq_offset
    segs = [(Segment(s, 0, 7),), (Segment(s, 7, 18),), (Segment(s, 18, 29), Segment(s + 1, 0, 6)),
            (Segment(s + 2, 0, 9), Segment(s + 3, 0, 4)), (Segment(s + 4, 0, 3),)]
    units = [Unit(first_id + i, sg, dp_rank=dp_rank) for i, sg in enumerate(segs)]
    backward = [units[2], units[1], units[0], units[3], units[4]]  # slices last first
    return units, backward


def gpipe(units, backward, pp):
    return [[F(u.id) for u in units] + [B(u.id) for u in reversed(units)] for _ in range(pp)]


def one_f_one_b(units, backward, pp, n_split=3):
    lists = []
    for r in range(pp):
        warm = min(len(units), pp - 1 - r + n_split - 1)
        acts = [F(u.id) for u in units[:warm]]
        fi, bi = warm, 0
        while fi < len(units):
            acts += [F(units[fi].id), B(backward[bi].id)]
            fi, bi = fi + 1, bi + 1
        acts += [B(u.id) for u in backward[bi:]]
        lists.append(acts)
    return lists


def make_plan(pp, order="1f1b", ckpt="some", dp=1, lengths=LENGTHS):
    units, actions = [], {}
    per = len(lengths) // dp
    for r in range(dp):
        us, bw = mixed_units(r, first_id=5 * r, seq_offset=per * r)
        units += us
        actions[r] = (gpipe if order == "gpipe" else one_f_one_b)(us, bw, pp)
    layers = [len(x) for x in partition_layers(NUM_LAYERS, pp)]
    counts = {"none": lambda s, i: 0, "all": lambda s, i: layers[s],
              "some": lambda s, i: (i + s) % (layers[s] + 1)}[ckpt]
    ck = {s: {u.id: counts(s, u.id) for u in units} for s in range(pp)}
    return Plan("test", pp, dp, list(lengths), units, actions, ck, layers_per_stage=layers)


def build_stages(model, pp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [build_stage(copy.deepcopy(model), i, r)
                for i, r in enumerate(partition_layers(NUM_LAYERS, pp))]


def collect_grads(stages, tied):
    got = {}
    for st in stages:
        for name, p in st.named_parameters():
            if p.grad is None:
                continue
            if tied and name == "lm_head.weight":
                name = "model.embed_tokens.weight"  # the engine sums the tied pair's gradients
            got[name] = got[name] + p.grad if name in got else p.grad.clone()
    return got


def check(model, stages, plan, batch, tied=False, chunk=5):
    ref_loss, ref = reference_loss_and_grads(model, batch)
    loss = run_plan_locally(stages, plan, batch, loss_chunk_tokens=chunk)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    got = collect_grads(stages, tied)
    assert set(got) == set(ref)
    assert_grads_close(got, ref, rtol=1e-10)


# Per-stage mixes (whole, mlp, mlp_act[, keep_attn]) cycled over (stage, unit): stages hold 2
# layers at pp 2.
MIX_CYCLE = [(0, 2, 0), (0, 0, 2, 0), (1, 1, 0), (0, 0, 0, 2), (0, 1, 1), (1, 0, 0, 1), (1, 0, 1),
             (0, 0, 1, 1), (0, 0, 0)]


def with_levels(plan, mixes):
    """Give the plan ``mixes[(stage + unit) % len]`` per cell, clipped to the stage's layers."""
    ck, levels = {}, {}
    for s, layers in enumerate(plan.layers_per_stage):
        for u in plan.units:
            full, mlp, act, keep = (*mixes[(s + u.id) % len(mixes)], 0)[:4]
            full = min(full, layers)
            keep = min(keep, layers - full)
            mlp = min(mlp, layers - full - keep)
            m = CheckpointMix(full, mlp, min(act, layers - full - keep - mlp), keep)
            ck.setdefault(s, {})[u.id] = m.full
            if m.finer:
                levels.setdefault(s, {})[u.id] = m.finer
    plan.checkpoint_layers, plan.checkpoint_levels = ck, levels
    return plan
