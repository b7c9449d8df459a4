"""StageRunner converts each sequence once per step (``SequenceCache``); the per-unit path it
replaced (``cache_sequences=False``) gives bit-identical losses and gradients."""
import copy

import torch

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.stage.module import build_stage
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count
from tests.helpers.reference import random_batch, tiny_model


def _step(model, cache: bool):
    lengths = [20, 6, 5]
    batch = [{"input_ids": list(map(int, b["input_ids"]))} for b in random_batch(lengths)]
    units = [Unit(0, (Segment(0, 0, 8),)), Unit(1, (Segment(0, 8, 14),)), Unit(2, (Segment(0, 14, 20), Segment(1, 0, 6))),
             Unit(3, (Segment(2, 0, 5),))]
    acts = [Action("F", u.id) for u in units] + [Action("B", u.id) for u in reversed(units)]
    plan = Plan("epp", 1, 1, lengths, units, {0: [acts]}, {0: {}}, [4])
    runner = StageRunner(build_stage(model, 0, range(0, 4)), loss_chunk_tokens=4, cache_sequences=cache)
    runner.begin_step(plan, batch, label_token_count(batch))
    loss = 0.0
    for a in acts:
        if a.is_forward:
            loss += float(runner.forward(a.unit, None))
        else:
            runner.backward(a.unit, None)
    runner.end_step()
    return loss, {n: p.grad.clone() for n, p in runner.stage.named_parameters()}


def test_converting_sequences_once_changes_no_bit():
    model = tiny_model()
    loss_a, grads_a = _step(copy.deepcopy(model), True)
    loss_b, grads_b = _step(copy.deepcopy(model), False)
    assert loss_a == loss_b and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
