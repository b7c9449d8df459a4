"""A NaN or infinite loss or gradient norm stops the job naming the step, the rank and the unit
(``nonfinite_policy="stop"``) or skips that step's update (``"skip"``); a model with non-finite
parameters is never saved.  One process here; ``tests/distributed/test_trainer_nonfinite.py``
runs the same on two ranks."""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf.ir.plan import Plan  # noqa: E402
from infinipipe_hf.ir.units import Segment, Unit  # noqa: E402
from infinipipe_hf.trainer.nonfinite import (  # noqa: E402
    NonFiniteError,
    NonFiniteGuard,
    check_parameters,
    nonfinite_names,
)


class _Layout:
    def describe(self, rank=None):
        return "rank 0 (stage 0, dp 0)"


class _Engine:
    """What the guard reads of a ``PipelineEngine``: named parameters and the layout."""

    def __init__(self):
        self.layout = _Layout()
        self.params = {"w": torch.nn.Parameter(torch.ones(3)), "v": torch.nn.Parameter(torch.ones(2))}
        for p in self.params.values():
            p.grad = torch.zeros_like(p)

    def named_parameters(self):
        return iter(self.params.items())


def _out(loss: float, units=()):
    plan = Plan(schedule="epp", pp_degree=1, dp_degree=1, sequences=[5, 9],
                units=[Unit(id=0, segments=(Segment(0, 0, 5),)), Unit(id=1, segments=(Segment(1, 0, 9),))],
                actions={0: [[]]}, checkpoint_layers={})
    return SimpleNamespace(loss=loss, nonfinite_units=tuple(units), plan=plan)


def test_finite_steps_pass_and_a_nan_loss_stops_naming_step_rank_and_unit():
    engine = _Engine()
    guard = NonFiniteGuard("stop", engine)
    guard.record(_out(2.5))
    assert guard.decide(1.0, step=6) is False
    guard.record(_out(math.nan, units=[1]))
    engine.params["v"].grad[1] = math.inf
    with pytest.raises(NonFiniteError, match=r"^step 7: the loss is nan and the gradient norm is inf; "
                                             r"non-finite token losses on rank 0 \(stage 0, dp 0\) from "
                                             r"unit 1 \(seq 1 tokens 0:9\); non-finite gradients on rank 0 "
                                             r"\(stage 0, dp 0\): v\. .*nonfinite_policy='skip'"):
        guard.decide(math.inf, step=7)


def test_a_nan_gradient_norm_alone_stops_even_with_a_finite_loss():
    engine = _Engine()
    engine.params["w"].grad[0] = math.nan
    guard = NonFiniteGuard("stop", engine)
    guard.record(_out(1.0))
    with pytest.raises(NonFiniteError, match=r"step 3: the gradient norm is nan; non-finite gradients on "
                                             r"rank 0 \(stage 0, dp 0\): w\."):
        guard.decide(math.nan, step=3)
    engine.params["w"].grad.zero_()
    with pytest.raises(NonFiniteError, match=r"step 4: the gradient norm is inf; every gradient element is "
                                             r"finite \(their sum of squares overflowed\)\."):
        guard.decide(math.inf, step=4)  # each rank finite, the sum not: said so, not blamed on a rank


def test_skip_drops_the_update_holds_the_scheduler_and_counts():
    engine = _Engine()
    guard = NonFiniteGuard("skip", engine)
    optimizer = SimpleNamespace(param_groups=[{"params": list(engine.params.values())}], scaler=None,
                                _is_overflow=False)
    assert guard.log_fields() == {}
    guard.record(_out(math.inf, units=[0]))
    with pytest.warns(UserWarning, match=r"step 4: the loss is inf.*unit 0 \(seq 0 tokens 0:5\).*Step 4 is "
                                         r"skipped .*1 skipped so far"):
        assert guard.decide(2.0, step=4, optimizer=optimizer) is True
    assert all(p.grad is None for p in engine.params.values())  # the optimizer updates nothing
    assert optimizer._is_overflow is True  # accelerate: optimizer_step_was_skipped, LR held
    assert guard.log_fields() == {"nonfinite_skipped_steps": 1.0}
    guard.record(_out(1.0))
    assert guard.decide(1.0, step=5, optimizer=optimizer) is False
    assert optimizer._is_overflow is False  # the next finite step updates and schedules again
    assert guard.log_fields() == {"nonfinite_skipped_steps": 1.0}
    plain = SimpleNamespace(param_groups=[{"params": list(engine.params.values())}])
    guard.record(_out(math.nan))
    with pytest.warns(UserWarning, match="the learning-rate scheduler advances on skipped steps"):
        assert guard.decide(1.0, step=6, optimizer=plain) is True  # said, never silently different


def test_unknown_policy_and_nonfinite_parameters_are_refused(tmp_path):
    from infinipipe_hf import EPPTrainingArguments

    with pytest.raises(ValueError, match="nonfinite_policy='ignore' is not known; use 'stop'"):
        NonFiniteGuard("ignore", _Engine())
    with pytest.raises(ValueError, match="nonfinite_policy='ignore' is not known"):
        EPPTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, nonfinite_policy="ignore")
    engine = _Engine()
    check_parameters(engine, "out/checkpoint-3")  # finite: nothing to say
    with torch.no_grad():
        engine.params["v"][0] = math.nan
    with pytest.raises(NonFiniteError, match=r"refusing to save out/checkpoint-3: .*rank 0 \(stage 0, dp 0\): v\)"):
        check_parameters(engine, "out/checkpoint-3")
    assert nonfinite_names([("a", None), ("b", torch.tensor([1.0, -math.inf]))]) == ["b"]


# --- one process, a real trainer ---------------------------------------------------------------
pytest.importorskip("datasets")

from tests.distributed.workers.trainer_common import SCENARIOS, epp_trainer, slicing_planner  # noqa: E402

NAN_STEP = 3


def inject_nan_gradient(trainer, step: int, name: str = "model.layers.2.mlp.up_proj.weight"):
    """After the backward of optimizer step ``step`` (1-based), one gradient element becomes NaN."""
    train_step = trainer.training_step

    def training_step(*a, **kw):
        loss = train_step(*a, **kw)
        if trainer.state.global_step + 1 == step:
            dict(trainer.engine.named_parameters())[name].grad.view(-1)[0] = math.nan
        return loss

    trainer.training_step = training_step


class _Weights:
    """The stage's parameters at the end of every step."""

    def __init__(self):
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, trainer):
        from transformers import TrainerCallback

        store = self

        class Snap(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                store.after[state.global_step] = {n: p.detach().clone()
                                                  for n, p in trainer.engine.named_parameters()}
        trainer.add_callback(Snap())
        return self


def test_world1_skip_policy_skips_the_nan_step_and_trains_on(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = epp_trainer(SCENARIOS["base"], str(tmp_path), 1, planner=slicing_planner,
                         save_strategy="steps", save_steps=2, nonfinite_policy="skip")
    inject_nan_gradient(tr, NAN_STEP)
    weights = _Weights()(tr)
    with pytest.warns(UserWarning, match=rf"step {NAN_STEP}: the gradient norm is nan; non-finite gradients "
                                         r"on rank 0 \(stage 0, dp 0\): model\.layers\.2\.mlp\.up_proj\.weight"):
        tr.train()
    assert tr.state.global_step == 4
    before, skipped, after = (weights.after[s] for s in (NAN_STEP - 1, NAN_STEP, NAN_STEP + 1))
    assert all(torch.equal(before[n], skipped[n]) for n in before)  # no update, no weight decay
    assert any(not torch.equal(skipped[n], after[n]) for n in before)  # the next step trains
    assert all(torch.isfinite(p).all() for p in after.values())
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert [math.isnan(h["grad_norm"]) for h in logs] == [False, False, True, False]
    lrs = [h["learning_rate"] for h in logs]
    assert lrs[NAN_STEP] == lrs[NAN_STEP - 1] < lrs[NAN_STEP - 2]  # the scheduler held for the skip
    assert [h.get("nonfinite_skipped_steps", 0) for h in logs] == [0, 0, 1, 1]
    assert tr.lr_scheduler.last_epoch == 3


def test_world1_stop_policy_raises_before_the_update_and_saves_nothing_after(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = epp_trainer(SCENARIOS["base"], str(tmp_path), 1, planner=slicing_planner,
                         save_strategy="steps", save_steps=1)
    inject_nan_gradient(tr, NAN_STEP)
    weights = _Weights()(tr)
    with pytest.raises(NonFiniteError, match=rf"^step {NAN_STEP}: the gradient norm is nan; .*rank 0 "
                                             r"\(stage 0, dp 0\): model\.layers\.2\.mlp\.up_proj\.weight"):
        tr.train()
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == ["checkpoint-1", "checkpoint-2"]
    assert sorted(weights.after) == [1, 2]
    assert all(torch.isfinite(p).all() for _, p in tr.engine.named_parameters())  # never updated with NaN
