"""EPPTrainer with ``state_offload='optimizer'`` in one process (world 1): the optimizer the Trainer
creates is wrapped (AdamW states and masters on the host, step on the CPU), losses and trained
weights equal HF's plain Trainer (float64), the checkpoint holds host states and a resume from it
reproduces the uninterrupted run."""
from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("datasets")

from infinipipe_hf.runtime.offload.host_optimizer import HostOptimizer  # noqa: E402
from tests.distributed.workers.trainer_common import (  # noqa: E402
    SCENARIOS,
    assert_close_list,
    assert_weights_match,
    epp_trainer,
    load_reference,
    per_step,
    reference_run,
    slicing_planner,
    stage_state,
)


def test_host_optimizer_matches_plain_trainer_and_resumes_exactly(tmp_path):
    scn = SCENARIOS["base"]
    refs, out = str(tmp_path / "refs"), str(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_run(scn, refs)
        ref, ref_w = load_reference(refs, "base")
        a = epp_trainer(scn, out, 1, planner=slicing_planner, state_offload="optimizer",
                        save_strategy="steps", save_steps=2)
        a.train()
    inner = getattr(a.optimizer, "optimizer", a.optimizer)  # accelerate's wrapper around ours
    assert isinstance(inner, HostOptimizer), type(inner)
    assert a.engine.host_tier.stats.resident["optimizer"] == inner.host_bytes() > 0
    assert_close_list(per_step(a, scn), ref["losses"], "host-optimizer losses")
    assert_weights_match(stage_state(a), ref_w, "host-optimizer weights")
    saved = torch.load(os.path.join(out, "checkpoint-2", "optimizer.stage0.pt"), weights_only=True)
    assert saved["state"] and all(t.device.type == "cpu" for st in saved["state"].values() for t in st.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = epp_trainer(scn, out, 1, planner=slicing_planner, state_offload="optimizer")
        b.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert_close_list(per_step(b, scn), per_step(a, scn)[2:], "resumed losses", 1e-12)
    for n, w in stage_state(a).items():
        assert torch.equal(stage_state(b)[n], w), f"{n}: the resumed run's weight differs"


def test_every_state_on_the_host_on_one_rank_matches_plain_trainer_and_resumes(tmp_path):
    """``state_offload='states'`` on one process: FSDP2's CPU offload over the rank alone."""
    import torch.distributed as dist

    scn = SCENARIOS["base"]
    refs, out = str(tmp_path / "refs"), str(tmp_path / "run")
    ours = not dist.is_initialized()  # the engine starts a one-rank group: leave none behind
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference_run(scn, refs)
            ref, ref_w = load_reference(refs, "base")
            a = epp_trainer(scn, out, 1, planner=slicing_planner, state_offload="states",
                            save_strategy="steps", save_steps=2)
            a.train()
            assert a.engine.sharding is not None and a.engine.sharding.offload
            assert_close_list(per_step(a, scn), ref["losses"], "host-states losses")
            from infinipipe_hf.runtime.parallel.fsdp_api import full_tensor

            trained = {n: full_tensor(t) for n, t in stage_state(a).items()}
            assert_weights_match(trained, ref_w, "host-states weights")
            b = epp_trainer(scn, out, 1, planner=slicing_planner, state_offload="states")
            b.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        assert_close_list(per_step(b, scn), per_step(a, scn)[2:], "resumed losses", 1e-12)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
