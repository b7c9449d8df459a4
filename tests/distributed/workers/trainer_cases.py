"""EPPTrainer worker: many cases in one launch (process start-up is the expensive part).

``trainer_cases.py SUITE REF_DIR OUT_DIR PLANNER`` under torchrun or accelerate launch.  The
references (plain HF ``Trainer``, one process) were written to REF_DIR by the test process.
Suites: ``pp2`` (2 ranks), ``world4`` (4 ranks), ``accel2`` / ``accel4`` (short ones for the
accelerate launcher).  PLANNER: ``default`` (the engine's planner) or ``slicing`` (a fixed plan
with sliced sequences, independent of the planner).  Prints ``CASE <name> OK`` per passed case
and ``ALL OK``; any failure raises (non-zero exit).
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from trainer_common import (
    GA_RTOL,
    LOSS_RTOL,
    SCENARIOS,
    assert_close_list,
    assert_weights_match,
    dp_of,
    epp_trainer,
    load_reference,
    make_model,
    per_step,
    slicing_planner,
    stage_state,
)

warnings.filterwarnings("ignore", category=FutureWarning)
SUITE, REF_DIR, OUT_DIR, PLANNER = sys.argv[1:5]
PLAN = slicing_planner if PLANNER == "slicing" else None


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def train_match(scn_name: str, pp: int, tag: str, eval_set: bool = False) -> None:
    """Losses, grad norms and trained weights equal the single-process Trainer's."""
    t0 = time.time()
    scn = SCENARIOS[scn_name]
    ref, ref_w = load_reference(REF_DIR, scn_name, dp_of(pp))
    tr = epp_trainer(scn, os.path.join(OUT_DIR, tag), pp, eval_set=eval_set, planner=PLAN)
    tr.train()
    rtol = GA_RTOL if scn.grad_accum > 1 else LOSS_RTOL
    worst = assert_close_list(per_step(tr, scn), ref["losses"], f"{tag} losses", rtol)
    norms = [h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h]
    assert_close_list(norms, ref["grad_norms"], f"{tag} grad norms", max(rtol, 1e-9))
    wworst = assert_weights_match(stage_state(tr), ref_w, f"{tag} weights", rtol)
    msg = ""
    if eval_set:
        ev = tr.evaluate()["eval_loss"]
        assert abs(ev - ref["eval_loss"]) <= rtol * abs(ref["eval_loss"]), (ev, ref["eval_loss"])
        msg = f" eval_loss={ev:.12f}"
    # Every plan computed ahead; with the default planner ranks may disagree (its MILP solver
    # has a wall-clock limit) and such a step is re-planned by the engine instead.
    steps = scn.max_steps * scn.grad_accum
    assert tr.plan_ahead.hits == steps if PLAN is not None else 1 <= tr.plan_ahead.hits <= steps
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert all("tokens_per_s" in h and "recomputed_layers_per_step" in h for h in logged), logged[0]
    log(f"CASE {tag} OK loss_rel={worst:.1e} weight_rel={wworst:.1e}{msg} {time.time() - t0:.1f}s")


def resume_and_save(scn_name: str, pp: int, tag: str) -> None:
    """Save at step 2, resume from it: steps 3-4 equal the uninterrupted run; save_model loads."""
    t0 = time.time()
    scn = SCENARIOS[scn_name]
    ref, ref_w = load_reference(REF_DIR, scn_name, dp_of(pp))
    out = os.path.join(OUT_DIR, tag)
    a = epp_trainer(scn, out, pp, planner=PLAN, save_strategy="steps", save_steps=2)
    a.train()
    assert_close_list(per_step(a, scn), ref["losses"], f"{tag} uninterrupted losses")
    b = epp_trainer(scn, out, pp, planner=PLAN, save_strategy="no")
    b.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert b.state.global_step == scn.max_steps
    assert_close_list(per_step(b, scn), per_step(a, scn)[2:], f"{tag} resumed losses", 1e-12)
    assert_weights_match(stage_state(b), stage_state(a), f"{tag} resumed weights", 1e-12)
    final = os.path.join(out, "final")
    b.save_model(final)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64)
        assert loaded.config._attn_implementation != "epp", loaded.config._attn_implementation
        state = loaded.state_dict()
        assert set(state) == set(ref_w), sorted(set(state) ^ set(ref_w))[:5]
        assert_weights_match(state, ref_w, f"{tag} from_pretrained weights")
        if scn.tie:
            assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    dist.barrier()
    log(f"CASE {tag} OK {time.time() - t0:.1f}s")


def lora(pp: int, tag: str) -> None:
    """Only adapters train (base frozen and unchanged); the merged adapter loads with PEFT."""
    t0 = time.time()
    scn = SCENARIOS["lora"]
    ref, ref_w = load_reference(REF_DIR, "lora", dp_of(pp))
    out = os.path.join(OUT_DIR, tag)
    tr = epp_trainer(scn, out, pp, planner=PLAN)
    initial = dict(make_model(scn).named_parameters())
    tr.train()
    assert_close_list(per_step(tr, scn), ref["losses"], f"{tag} losses")
    assert_weights_match(stage_state(tr), ref_w, f"{tag} adapter weights")
    changed = 0
    for name, p in tr.engine.named_parameters():
        before = initial["base_model.model." + name]
        if "lora_" in name:
            assert p.requires_grad, name
            changed += int((p - before).abs().max().item() > 1e-6)
        else:
            assert not p.requires_grad and torch.equal(p, before), f"base weight {name} changed"
    assert changed > 0, "no adapter weight changed"
    tr.save_model(os.path.join(out, "adapter"))
    if dist.get_rank() == 0:
        from peft import PeftModel
        from peft.utils import get_peft_model_state_dict

        from tests.helpers.reference import tiny_model

        base = tiny_model("llama", seed=0, num_layers=scn.num_layers, tie=scn.tie)
        loaded = PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
        state = get_peft_model_state_dict(loaded)
        assert set(state) == set(ref_w), sorted(set(state) ^ set(ref_w))[:5]
        assert_weights_match(state, ref_w, f"{tag} PeftModel.from_pretrained adapter")
    dist.barrier()
    log(f"CASE {tag} OK adapters_changed={changed} {time.time() - t0:.1f}s")


def bad_pp(pp: int, tag: str) -> None:
    try:
        epp_trainer(SCENARIOS["base"], os.path.join(OUT_DIR, tag), pp, planner=PLAN)
    except ValueError as exc:
        assert "does not divide" in str(exc) and str(dist.get_world_size()) in str(exc), str(exc)
        log(f"CASE {tag} OK error={str(exc)[:80]!r}")
        return
    raise AssertionError(f"{tag}: pp_degree={pp} on {dist.get_world_size()} processes did not raise")


SUITES = {
    "pp2": [lambda: train_match("base", 2, "pp2_base_eval", eval_set=True),
            lambda: train_match("ga2", 2, "pp2_grad_accum"),
            lambda: resume_and_save("tied", 2, "pp2_tied_resume_save"),
            lambda: lora(2, "pp2_lora"),
            lambda: train_match("long_docs", 1, "pp1dp2_long_docs"),
            lambda: bad_pp(3, "pp3_on_2_processes")],
    "world4": [lambda: train_match("tied", 4, "pp4_tied_eval", eval_set=True),
               lambda: resume_and_save("base", 2, "dp2pp2_resume_save"),
               lambda: train_match("long_docs", 2, "dp2pp2_long_docs"),
               lambda: lora(4, "pp4_lora"),
               lambda: bad_pp(3, "pp3_on_4_processes")],
    "accel2": [lambda: train_match("base", 2, "accel_pp2_base")],
    "accel4": [lambda: train_match("base", 4, "accel_pp4_base"),
               lambda: train_match("tied", 2, "accel_dp2pp2_tied")],
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in SUITES[SUITE]:
        case()
    print(f"[rank {dist.get_rank()}] planner={PLANNER} ALL OK", flush=True)
