"""Exact-gradient worker: many cases in one launch (process start-up is the expensive part).

``exact_grads.py pp2`` (2 ranks): pp 2 cases for Llama/Mistral/Qwen2, tied and untied, checkpoint
counts none/all/mixed, whole layers mixed with the finer levels inside layers, accumulation, eval,
gradient clipping, user errors.
``exact_grads.py world4`` (4 ranks): pp 4 and dp 2 x pp 2 cases, DP accumulation, timelines.
Prints ``CASE <name> OK`` per passed case and ``ALL OK``; any failure raises (non-zero exit).
"""
from __future__ import annotations

import math
import sys

from common import (
    CKPT,
    LENGTHS,
    UNITS_DP1,
    UNITS_DP2,
    InfiniPipeConfig,
    PipelineEngine,
    check_grads,
    dist,
    expect_value_error,
    init,
    log,
    make_plan,
    random_batch,
    reference,
    run_case,
    tiny_model,
    torch,
)


def accumulation(name: str, *, family: str, tie: bool, pp: int, units_a, units_b, lengths_b) -> None:
    """Two train_steps accumulate: .grad equals the sum of both batches' reference gradients."""
    batch_a = random_batch(LENGTHS, seed=11, with_labels=True)
    batch_b = random_batch(lengths_b, seed=12)
    losses, want, _ = reference(family, tie, [batch_a, batch_b])
    engine = PipelineEngine(tiny_model(family, tie=tie), InfiniPipeConfig(pp_degree=pp, p2p_timeout_s=60))
    lps = engine.layers_per_stage
    out_a = engine.train_step(batch_a, plan=make_plan(LENGTHS, units_a, pp, lps, CKPT["mixed"]))
    out_b = engine.train_step(batch_b, plan=make_plan(lengths_b, units_b, pp, lps))
    loss_rel = max(abs(got - exp) / abs(exp) for got, exp in zip((out_a.loss, out_b.loss), losses))
    assert loss_rel <= 1e-10, ((out_a.loss, out_b.loss), losses)
    worst = check_grads(engine, want)
    log(f"CASE {name} OK loss_rel={loss_rel:.2e} worst_rel={worst:.2e}")


def eval_and_clip(pp: int) -> None:
    batch = random_batch(LENGTHS, seed=21, with_labels=True)
    (want_loss,), want, ref = reference("llama", True, [batch])
    engine = PipelineEngine(tiny_model("llama", tie=True), InfiniPipeConfig(pp_degree=pp, p2p_timeout_s=60))
    plan = make_plan(LENGTHS, UNITS_DP1, pp, engine.layers_per_stage)
    got = engine.eval_step(batch, plan=plan)
    loss_rel = abs(got - want_loss) / abs(want_loss)
    assert loss_rel <= 1e-10, (got, want_loss)
    assert all(p.grad is None for p in engine.parameters()), "eval_step produced gradients"
    engine.train_step(batch, plan=plan)
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    norm = engine.clip_grad_norm_(0.05)
    assert want_norm > 0.05 and math.isclose(norm, want_norm, rel_tol=1e-10), (norm, want_norm)
    clipped = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    worst = check_grads(engine, clipped)
    log(f"CASE eval_and_clip OK eval_loss={got:.12f} loss_rel={loss_rel:.2e} norm={norm:.6e} "
        f"worst_rel={worst:.2e}")


def user_errors() -> None:
    import transformers

    world = dist.get_world_size()
    expect_value_error("pp_not_dividing_world", f"does not divide world size {world}",
                       lambda: PipelineEngine(tiny_model("llama"), InfiniPipeConfig(pp_degree=world + 1)))
    expect_value_error("pp_larger_than_layers", "larger than the model's 1 decoder layers",
                       lambda: PipelineEngine(tiny_model("llama", num_layers=1),
                                              InfiniPipeConfig(pp_degree=world)))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2,
                                                                vocab_size=50, bos_token_id=0,
                                                                eos_token_id=0))
    expect_value_error("unsupported_model", "not supported",
                       lambda: PipelineEngine(gpt2, InfiniPipeConfig(pp_degree=world)))


def plan_on_rank0() -> None:
    """seed_plan_on_rank0: only rank 0 plans; the others get the plan (or its error) broadcast."""
    batch = random_batch(LENGTHS, seed=31)
    (want_loss,), want, _ = reference("llama", False, [batch])

    def planner(lengths, engine):
        assert dist.get_rank() == 0, "planner called on a rank other than 0"
        return make_plan(lengths, UNITS_DP1, 2, engine.layers_per_stage)

    cfg = InfiniPipeConfig(pp_degree=2, seed_plan_on_rank0=True, p2p_timeout_s=60)
    engine = PipelineEngine(tiny_model("llama"), cfg, planner=planner)
    out = engine.train_step(batch)
    assert abs(out.loss - want_loss) <= 1e-10 * abs(want_loss)
    check_grads(engine, want)

    class Infeasible:
        plan, feasible, error = None, False, "unit of 9000 tokens exceeds the budget"

    bad = PipelineEngine(tiny_model("llama"), cfg, planner=lambda lengths, engine: Infeasible())
    expect_value_error("rank0_plan_error_reaches_all", "exceeds the budget", lambda: bad.train_step(batch))
    log("CASE plan_on_rank0 OK")


def plan_disagreement() -> None:
    """Ranks whose planner disagrees run rank 0's plan (with a warning); explicit plans that
    differ between ranks are a ValueError on every rank, never a hang."""
    import warnings

    batch = random_batch(LENGTHS, seed=51)
    (want_loss,), want, _ = reference("mistral", True, [batch])
    other = [[[(0, 0, 20)], [(0, 20, 37), (1, 0, 11)], [(4, 0, 23), (2, 0, 8)], [(3, 0, 5), (5, 0, 6)]]]
    mine = UNITS_DP1 if dist.get_rank() == 0 else other
    engine = PipelineEngine(tiny_model("mistral", tie=True), InfiniPipeConfig(pp_degree=2, p2p_timeout_s=60),
                            planner=lambda lengths, e: make_plan(lengths, mine, 2, e.layers_per_stage))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.train_step(batch)
    assert any("planned differently" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert len(out.plan.units) == 6 and abs(out.loss - want_loss) <= 1e-10 * abs(want_loss)
    check_grads(engine, want)
    plan = make_plan(LENGTHS, mine, 2, engine.layers_per_stage)
    expect_value_error("explicit_plans_differ", "differs from other ranks",
                       lambda: engine.train_step(batch, plan=plan))
    log("CASE plan_disagreement OK")


def pp2() -> None:
    run_case("pp2_llama_untied_ckpt_none", family="llama", tie=False, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP1)
    run_case("pp2_mistral_tied_ckpt_all", family="mistral", tie=True, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP1, ckpt="all", labels=True)
    run_case("pp2_qwen2_untied_ckpt_mixed", family="qwen2", tie=False, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP1, ckpt="mixed", labels=True)
    run_case("pp2_llama_tied_split13", family="llama", tie=True, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP1, ckpt="mixed", layer_split=[1, 3])
    run_case("pp2_mistral_untied_ckpt_levels", family="mistral", tie=False, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP1, ckpt="mixed", labels=True, levels=True)
    accumulation("pp2_accumulation", family="qwen2", tie=True, pp=2, units_a=UNITS_DP1,
                 units_b=[[[(0, 0, 6)], [(0, 6, 9), (1, 0, 4)]]], lengths_b=[9, 4])
    eval_and_clip(2)
    plan_on_rank0()
    plan_disagreement()
    user_errors()


def default_planner(name: str, *, pp: int, family: str, tie: bool) -> None:
    """The engine's own planner (plan_step) on a batch long enough to be sliced."""
    from infinipipe_hf.ir.units import UnitKind

    lengths = [700, 130, 90, 60, 300, 20]
    batch = random_batch(lengths, seed=41, with_labels=True)
    (want_loss,), want, _ = reference(family, tie, [batch])
    cfg = InfiniPipeConfig(pp_degree=pp, max_tokens_per_unit=256, p2p_timeout_s=60)
    engine = PipelineEngine(tiny_model(family, tie=tie), cfg)
    out = engine.train_step(batch)
    kinds = {u.kind(lengths) for u in out.plan.units}
    assert UnitKind.SLICE in kinds or UnitKind.HYBRID in kinds, (kinds, str(out.plan))
    loss_rel = abs(out.loss - want_loss) / abs(want_loss)
    assert loss_rel <= 1e-10, (out.loss, want_loss)
    worst = check_grads(engine, want)
    log(f"CASE {name} OK units={len(out.plan.units)} kinds={sorted(k.value for k in kinds)} "
        f"loss_rel={loss_rel:.2e} worst_rel={worst:.2e}")


def world4() -> None:
    run_case("pp4_llama_untied_ckpt_mixed", family="llama", tie=False, pp=4, lengths=LENGTHS,
             units_per_dp=UNITS_DP1, ckpt="mixed", labels=True)
    run_case("pp4_qwen2_tied_ckpt_all", family="qwen2", tie=True, pp=4, lengths=LENGTHS,
             units_per_dp=UNITS_DP1, ckpt="all")
    run_case("pp4_mistral_untied_ckpt_none", family="mistral", tie=False, pp=4, lengths=LENGTHS,
             units_per_dp=UNITS_DP1)
    run_case("dp2pp2_llama_tied_ckpt_mixed", family="llama", tie=True, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP2, ckpt="mixed", labels=True)
    run_case("dp2pp2_mistral_untied_ckpt_all", family="mistral", tie=False, pp=2, lengths=LENGTHS,
             units_per_dp=UNITS_DP2, ckpt="all")
    # A replica with no units (fewer sequences than replicas) still joins every reduction.
    run_case("dp2pp2_idle_replica", family="qwen2", tie=True, pp=2, lengths=[9, 4],
             units_per_dp=[[[(0, 0, 5)], [(0, 5, 9), (1, 0, 4)]], []], ckpt="mixed")
    accumulation("dp2pp2_accumulation", family="llama", tie=True, pp=2, units_a=UNITS_DP2,
                 units_b=[[[(0, 0, 6)], [(0, 6, 9)]], [[(1, 0, 4)]]], lengths_b=[9, 4])
    default_planner("default_planner_pp4", pp=4, family="llama", tie=False)
    default_planner("default_planner_dp2pp2", pp=2, family="qwen2", tie=True)
    # The merged timeline holds every rank's actions of the step exactly once.
    engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(pp_degree=4, p2p_timeout_s=60))
    plan = make_plan(LENGTHS, UNITS_DP1, 4, engine.layers_per_stage)
    out = engine.train_step(random_batch(LENGTHS), plan=plan)
    merged = engine.gather_timeline(out.timeline)
    want = sorted((s, str(a)) for s in range(4) for a in plan.stage_actions(0, s))
    assert sorted((e.stage, e.action) for e in merged.events) == want
    assert all(e.end_s >= e.start_s for e in merged.events) and 0 <= merged.bubble_fraction() < 1
    log(f"CASE pp4_timeline OK span={merged.span_s * 1e3:.1f}ms bubble={merged.bubble_fraction():.2f}")


if __name__ == "__main__":
    init()
    {"pp2": pp2, "world4": world4}[sys.argv[1]]()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
