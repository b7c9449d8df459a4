"""Per-unit gradient reduction of sharded stages (``grad_reduce="unit"``), gloo, float64.

``sp2`` (2 ranks): pp 1 x sp 2, shard "sp": hand-made plans with elastic SP rounds (each rank
runs its own single-rank units side by side) and on the whole SP group, the engine's own planner
with ``grad_reduce="unit"`` (two accumulated steps) and with ``"auto"``; each against the unsplit
single-process HF model (loss and every gradient, 1e-10 relative).  After every unit's backward
no decoder layer or embedding holds an unsharded gradient under ``unit`` (and does under
``step``, the control).  Refusals: a ``unit`` plan on unsharded stages, ``unit`` on shard "dp"
over 2 replicas or shard "none", an unknown value; a good step still runs after a refused one.
``world4`` (4 ranks): pp 2 x sp 2 with rounds and dp 2 x sp 2 shard "sp" (the DP sum of
``grad_sync`` after per-unit reduce-scatters), exact; shard "hybrid" at dp 2 refuses ``unit``.
Prints ``CASE <name> OK`` per case and ``ALL OK``.
"""
from __future__ import annotations

import sys
import time

from common import CKPT, UNITS_DP1, InfiniPipeConfig, PipelineEngine, dist, expect_value_error, init, log
from sharded_grads import check_full_grads, close
from sp_rounds import CKPT_ROUND, DP2_SP2, LENGTHS, SP2, engine_for, reference

from tests.distributed.plans import make_plan
from tests.distributed.round_plans import rounds_plan
from tests.helpers.reference import random_batch, tiny_model


def unsharded_grad_elements(sharding, kept: bool) -> int:
    """Elements of unsharded gradients held by the modules kept gathered (``kept``) or the others."""
    from torch.distributed.fsdp import fully_shard

    n = 0
    for m in sharding.modules:
        if (id(m) in sharding.keep_gathered) != kept:
            continue
        for fp in fully_shard.state(m)._fsdp_param_group.fsdp_params:
            g = fp.unsharded_accumulated_grad
            if g is None and hasattr(fp, "_unsharded_param"):
                g = fp._unsharded_param.grad
            n += 0 if g is None else g.numel()
    return n


def probe_backwards(engine) -> tuple[list[int], list[int]]:
    """After each backward of ``engine``'s runner: unsharded gradient elements of the decoder layers
    and embeddings, and of the final norm and LM head (kept gathered through the step)."""
    seen: list[int] = []
    head: list[int] = []
    real = engine.runner.backward

    def backward(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(unsharded_grad_elements(engine.sharding, kept=False))
        head.append(unsharded_grad_elements(engine.sharding, kept=True))
        return out

    engine.runner.backward = backward
    return seen, head


def hand_case(name, plan_of, *, lengths, pp, sp, mode, tie=True, family="llama", shard="sp"):
    """A hand-made plan with ``grad_reduce=mode``: exact, and what outlives each unit's backward."""
    t0 = time.time()
    batch = random_batch(lengths, seed=5, with_labels=True)
    want_loss, want = reference(family, tie, batch, "gqa2", pp)
    engine = engine_for(family, tie, pp=pp, sp=sp, shape="gqa2", shard=shard)
    plan = plan_of(engine)
    plan.grad_reduce = mode
    seen, head = probe_backwards(engine)
    out = engine.train_step(batch, plan=plan)
    close(out.loss, want_loss, f"{name} loss")
    worst = check_full_grads(engine, want)
    assert seen, name
    last = engine.layout.is_last_stage
    if mode == "unit":
        assert max(seen) == 0, (name, seen)  # no unsharded gradient outlives a unit
        # The head is reduced with the norm; only a tied head grouped with the embeddings (pp 1)
        # still holds the embeddings' part, reduced with the next unit.
        assert max(head) == 0 or (tie and pp == 1), (name, head)
    else:
        assert min(seen) > 0 and (min(head) > 0 or not last), (name, seen, head)  # the control keeps them
    log(f"CASE {name} OK loss={out.loss:.12f} worst_rel={worst:.2e} unsharded_after_backward={seen} "
        f"head_after_backward={head} {time.time() - t0:.2f}s")


def planner_case(name, *, grad_reduce, steps=1):
    """The engine's own planner: the plan says what it was priced with and runs exactly."""
    t0 = time.time()
    lengths = [300, 40, 30, 20, 12, 9, 7, 5]
    batch = random_batch(lengths, seed=5, with_labels=True)
    want_loss, want = reference("llama", False, batch, "gqa2", 1)
    engine = engine_for("llama", False, pp=1, sp=2, shape="gqa2", shard="sp", sp_rounds=True,
                        max_tokens_per_unit=128, grad_reduce=grad_reduce)
    for _ in range(steps):
        out = engine.train_step(batch)
    close(out.loss, want_loss, f"{name} loss")
    if grad_reduce != "auto":
        assert out.plan.grad_reduce == grad_reduce, (name, out.plan.grad_reduce)
    assert out.plan.grad_reduce in ("step", "unit") and out.plan.rounds, (name, out.plan.grad_reduce)
    worst = check_full_grads(engine, {n: g * steps for n, g in want.items()})
    log(f"CASE {name} OK picked={out.plan.grad_reduce} tried={out.plan.info.get('grad_reduce_tried')} "
        f"worst_rel={worst:.2e} {time.time() - t0:.2f}s")


def refusals_sp2() -> None:
    batch = random_batch(LENGTHS, seed=5, with_labels=True)
    engine = engine_for("llama", False, pp=1, sp=2, shape="gqa2")  # shard "none"
    plan = make_plan(LENGTHS, UNITS_DP1, 1, engine.layers_per_stage)
    plan.grad_reduce = "unit"
    expect_value_error("bad_unit_plan_on_unsharded", ["reduces gradients per unit", "shard='none'"],
                       lambda: engine.train_step(batch, plan=plan))
    plan.grad_reduce = "step"
    want_loss, _ = reference("llama", False, batch, "gqa2", 1)
    close(engine.train_step(batch, plan=plan).loss, want_loss, "good step after a refused one")
    log("CASE good_step_after_refusal OK")
    model = tiny_model
    expect_value_error("bad_config_unit_dp_replicas", ["shard='dp' at dp_degree=2", "grad_reduce='step'"],
                       lambda: PipelineEngine(model("llama", seed=0, num_layers=4), InfiniPipeConfig(
                           dp_degree=2, shard="dp", grad_reduce="unit", p2p_timeout_s=60)))
    expect_value_error("bad_config_unit_unsharded", ["shard='none'"],
                       lambda: PipelineEngine(model("llama", seed=0, num_layers=4), InfiniPipeConfig(
                           sp_degree=2, grad_reduce="unit", p2p_timeout_s=60)))
    expect_value_error("bad_grad_reduce_value", ["grad_reduce='layer'", "'unit'"],
                       lambda: InfiniPipeConfig(grad_reduce="layer"))


def sp2() -> None:
    def rounds(engine):
        return rounds_plan(LENGTHS, [SP2], pp=1, sp=2, layers_per_stage=engine.layers_per_stage,
                           checkpoint=CKPT_ROUND["mixed"], shard="sp")

    def whole(engine):
        return make_plan(LENGTHS, UNITS_DP1, 1, engine.layers_per_stage, checkpoint=CKPT["mixed"])

    hand_case("sp2_unit_rounds_tied", rounds, lengths=LENGTHS, pp=1, sp=2, mode="unit")
    hand_case("sp2_step_rounds_tied_control", rounds, lengths=LENGTHS, pp=1, sp=2, mode="step")
    hand_case("sp2_unit_whole_group_mistral", whole, lengths=LENGTHS, pp=1, sp=2, mode="unit", tie=False,
              family="mistral")
    planner_case("sp2_planner_unit_two_steps", grad_reduce="unit", steps=2)
    planner_case("sp2_planner_auto", grad_reduce="auto")
    refusals_sp2()


def world4() -> None:
    def rounds_pp2(engine):
        return rounds_plan(LENGTHS, [SP2], pp=2, sp=2, layers_per_stage=engine.layers_per_stage,
                           checkpoint=CKPT_ROUND["mixed"], shard="sp")

    def rounds_dp2(engine):
        return rounds_plan(LENGTHS, DP2_SP2, pp=1, sp=2, layers_per_stage=engine.layers_per_stage,
                           checkpoint=CKPT_ROUND["mixed"], shard="sp")

    hand_case("pp2sp2_unit_rounds_tied", rounds_pp2, lengths=LENGTHS, pp=2, sp=2, mode="unit")
    hand_case("dp2sp2_shard_sp_unit_rounds", rounds_dp2, lengths=LENGTHS, pp=1, sp=2, mode="unit")
    batch = random_batch(LENGTHS, seed=5, with_labels=True)
    engine = engine_for("llama", True, pp=1, sp=2, shape="gqa2", shard="hybrid")
    plan = rounds_dp2(engine)
    plan.grad_reduce = "unit"
    expect_value_error("dp2sp2_hybrid_unit_refused", ["shard='hybrid' at dp_degree=2"],
                       lambda: engine.train_step(batch, plan=plan))


if __name__ == "__main__":
    init()
    {"sp2": sp2, "world4": world4}[sys.argv[1]]()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
