"""Sequence-parallel exact-gradient worker: many cases in one launch.

``sp_exact.py sp2`` (2 ranks): sp 2 x pp 1: slices/packs/hybrids with checkpointing, units with
fewer tokens than ranks (pad tokens), eval, accumulation, clipping, bad input.
``sp_exact.py world4`` (4 ranks): pp 2 x sp 2 (Llama/Mistral/Qwen2/Qwen3, tied and untied, every
schedule of the default planner), pp 1 x sp 4 (GQA with 2 K/V heads, uneven heads, K/V heads
expanded per query head, one-token units), dp 2 x sp 2, bad input.
Every rank compares its loss and *every* gradient it holds with the unsplit float64 HF model (with
SP, each SP rank holds the full gradient after ``train_step``).  Prints ``CASE <name> OK``.
"""
from __future__ import annotations

import math
import sys
import time

from common import (
    CKPT,
    LENGTHS,
    UNITS_DP1,
    UNITS_DP2,
    InfiniPipeConfig,
    PipelineEngine,
    add_levels,
    check_grads,
    dist,
    expect_value_error,
    init,
    log,
    make_plan,
    random_batch,
    torch,
)

from tests.helpers.reference import reference_loss_and_grads, tiny_model

# Odd unit sizes (never divisible by 4, several by 2 neither) and units smaller than sp.
ODD_LENGTHS = [21, 1, 3, 9, 2]
ODD_UNITS = [[[(0, 0, 7)], [(0, 7, 12)], [(0, 12, 21), (1, 0, 1)], [(2, 0, 3)],
              [(3, 0, 1)], [(3, 1, 6), (4, 0, 2)], [(3, 6, 9)]]]


def model_kw(shape: str) -> dict:
    return {"mha4": dict(heads=4, kv_heads=4), "gqa2": dict(heads=4, kv_heads=2),
            # 8 heads, 2 K/V heads at sp 4: ranks share K/V heads (replication).
            "gqa8_2": dict(hidden=48, heads=8, kv_heads=2),
            # 10 heads over 4 ranks (2,3,2,3), groups of 2: ranks 1 and 3 straddle a K/V group
            # and expand K/V per query head.
            "gqa10_5": dict(hidden=40, heads=10, kv_heads=5),
            # 6 heads over 2 ranks (3,3), groups of 2: both ranks expand.
            "gqa6_3": dict(hidden=36, heads=6, kv_heads=3),
            # 6 heads, no GQA, over 4 ranks: 1,2,1,2.
            "mha6": dict(hidden=36, heads=6, kv_heads=6)}[shape]


def reference(family, tie, batches, shape="gqa2", num_layers=4, pp=2):
    """Loss per batch and summed gradients of the unsplit model.  With pp 1 a tied weight is one
    parameter of the stage (listed once); with pp > 1 the last stage lists it as ``lm_head``."""
    model = tiny_model(family, seed=0, num_layers=num_layers, tie=tie, **model_kw(shape))
    losses, total = [], {}
    for batch in batches:
        loss, _ = reference_loss_and_grads(model, batch)
        losses.append(loss)
        for n, p in model.named_parameters(remove_duplicate=pp == 1):
            total[n] = total.get(n, 0) + p.grad.detach().clone()
    return losses, total, model


def engine_for(family, tie, *, pp, sp, shape="gqa2", planner=None, **cfg):
    model = tiny_model(family, seed=0, num_layers=4, tie=tie, **model_kw(shape))
    return PipelineEngine(model, InfiniPipeConfig(pp_degree=pp, sp_degree=sp, p2p_timeout_s=60, **cfg),
                          planner=planner)


def close(got, want, what):
    assert abs(got - want) <= 1e-10 * abs(want), f"{what}: {got} vs {want}"


def sp_case(name, *, family="llama", tie=False, pp=1, sp=2, shape="gqa2", lengths=LENGTHS,
            units=UNITS_DP1, ckpt="mixed", labels=True, check_eval=False, expands=False, levels=False):
    t0 = time.time()
    batch = random_batch(lengths, seed=3, with_labels=labels)
    (want_loss,), want, _ = reference(family, tie, [batch], shape, pp=pp)
    engine = engine_for(family, tie, pp=pp, sp=sp, shape=shape)
    assert engine.layout.sp_degree == sp and engine.sequence_parallel is not None
    expanding: list = [None] * dist.get_world_size()
    dist.all_gather_object(expanding, engine.sequence_parallel.head.expand is not None)
    assert any(expanding) == expands, (name, expanding)  # the case covers what it says
    plan = make_plan(lengths, units, pp, engine.layers_per_stage, checkpoint=CKPT[ckpt])
    if levels:  # keep_attn and the MLP levels on the layers not checkpointed whole
        add_levels(plan, engine.layers_per_stage)
    if check_eval:
        close(engine.eval_step(batch, plan=plan), want_loss, f"{name} eval loss")
        assert all(p.grad is None for p in engine.parameters())
    out = engine.train_step(batch, plan=plan)
    close(out.loss, want_loss, f"{name} loss")
    worst = check_grads(engine, want)
    log(f"CASE {name} OK loss={out.loss:.12f} worst_rel={worst:.2e} {time.time() - t0:.2f}s")


def accumulation_and_clip(name, *, pp, sp):
    batch_a = random_batch(LENGTHS, seed=11, with_labels=True)
    batch_b = random_batch([9, 4], seed=12)
    losses, want, ref = reference("qwen2", True, [batch_a, batch_b], pp=pp)
    engine = engine_for("qwen2", True, pp=pp, sp=sp)
    lps = engine.layers_per_stage
    out_a = engine.train_step(batch_a, plan=make_plan(LENGTHS, UNITS_DP1, pp, lps, CKPT["mixed"]))
    out_b = engine.train_step(batch_b, plan=make_plan([9, 4], [[[(0, 0, 6)], [(0, 6, 9), (1, 0, 4)]]],
                                                      pp, lps))
    for got, exp in zip((out_a.loss, out_b.loss), losses):
        close(got, exp, f"{name} loss")
    check_grads(engine, want)
    for n, p in ref.named_parameters():
        p.grad = want[n].clone()
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    norm = engine.clip_grad_norm_(0.05)
    assert want_norm > 0.05 and math.isclose(norm, want_norm, rel_tol=1e-10), (norm, want_norm)
    worst = check_grads(engine, {n: p.grad for n, p in ref.named_parameters(remove_duplicate=pp == 1)})
    log(f"CASE {name} OK norm={norm:.6e} worst_rel={worst:.2e}")


def default_planner(name, *, schedule, pp, sp, family="llama", tie=False):
    """The engine's own planner, every schedule: EPP under a memory budget small enough for its
    solver to checkpoint some layers; baselines with every layer checkpointed."""
    from infinipipe_hf.ir.units import UnitKind

    lengths = [300, 130, 91, 61, 17, 5]
    batch = random_batch(lengths, seed=41, with_labels=True)
    (want_loss,), want, _ = reference(family, tie, [batch], pp=pp)
    knobs = (dict(max_tokens_per_unit=128, memory_budget_gib=0.001) if schedule == "epp"
             else dict(max_tokens_per_unit=300, checkpointing="full"))
    engine = engine_for(family, tie, pp=pp, sp=sp, schedule=schedule, **knobs)
    out = engine.train_step(batch)
    close(out.loss, want_loss, f"{name} loss")
    worst = check_grads(engine, want)
    kinds = sorted({u.kind(lengths).value for u in out.plan.units})
    ckpt = [out.plan.checkpointed(s, u.id) for s in range(pp) for u in out.plan.units]
    assert out.plan.schedule == schedule and any(ckpt), (schedule, ckpt)
    if schedule == "epp":
        assert {UnitKind.SLICE.value, UnitKind.HYBRID.value} <= set(kinds), kinds
        assert len(set(ckpt)) > 1, ckpt  # the solver's choice differs per (stage, unit)
    log(f"CASE {name} OK units={len(out.plan.units)} kinds={kinds} checkpointed={sum(ckpt)} "
        f"worst_rel={worst:.2e}")


def bad_input():
    world = dist.get_world_size()
    expect_value_error("sp_not_dividing_world", ["sp_degree=3", f"does not divide world size {world}"],
                       lambda: engine_for("llama", False, pp=1, sp=3))
    expect_value_error("pp_sp_not_dividing_world", [f"sp_degree={world}", "does not divide"],
                       lambda: engine_for("llama", False, pp=2, sp=world))
    # 1 attention head cannot be split over 2 ranks; the message lists what works.
    model = tiny_model("llama", num_layers=4, hidden=16, heads=1, kv_heads=1)
    expect_value_error("sp_more_than_heads", ["sp_degree=2", "1 attention heads", "sp_degree <= 1"],
                       lambda: PipelineEngine(model, InfiniPipeConfig(pp_degree=1, sp_degree=2)))


def sp2():
    sp_case("sp2_llama_untied_mixed", family="llama", sp=2, check_eval=True)
    sp_case("sp2_qwen3_tied_all", family="qwen3", tie=True, sp=2, shape="mha4", ckpt="all", labels=False)
    sp_case("sp2_mistral_odd_units", family="mistral", sp=2, lengths=ODD_LENGTHS, units=ODD_UNITS)
    sp_case("sp2_gqa6_3_expanded", family="qwen2", tie=True, sp=2, shape="gqa6_3", expands=True)
    sp_case("sp2_llama_levels", family="llama", sp=2, levels=True)
    accumulation_and_clip("sp2_accumulation_clip", pp=1, sp=2)
    bad_input()


def world4():
    sp_case("pp2sp2_llama_untied_mixed", family="llama", pp=2, sp=2, check_eval=True)
    sp_case("pp2sp2_mistral_tied_all", family="mistral", tie=True, pp=2, sp=2, ckpt="all")
    sp_case("pp2sp2_qwen2_untied_none_odd", family="qwen2", pp=2, sp=2, ckpt="none",
            lengths=ODD_LENGTHS, units=ODD_UNITS)
    sp_case("pp2sp2_qwen3_tied_mixed", family="qwen3", tie=True, pp=2, sp=2, shape="mha4")
    sp_case("sp4_gqa2_replicated", family="llama", pp=1, sp=4, shape="gqa2", check_eval=True)
    sp_case("sp4_gqa8_2_tied", family="qwen2", tie=True, pp=1, sp=4, shape="gqa8_2", ckpt="all")
    sp_case("sp4_gqa10_5_expanded", family="llama", pp=1, sp=4, shape="gqa10_5", expands=True)
    sp_case("sp4_mha6_uneven_heads", family="mistral", pp=1, sp=4, shape="mha6", ckpt="none")
    sp_case("sp4_gqa10_5_expanded_levels", family="llama", pp=1, sp=4, shape="gqa10_5", expands=True,
            levels=True)
    sp_case("pp2sp2_qwen2_levels", family="qwen2", pp=2, sp=2, levels=True)
    sp_case("sp4_odd_and_tiny_units", family="llama", tie=True, pp=1, sp=4, lengths=ODD_LENGTHS,
            units=ODD_UNITS)
    sp_case("dp2sp2_llama_tied_mixed", family="llama", tie=True, pp=1, sp=2, units=UNITS_DP2)
    sp_case("dp2sp2_qwen2_untied_all", family="qwen2", pp=1, sp=2, units=UNITS_DP2, ckpt="all")
    accumulation_and_clip("pp2sp2_accumulation_clip", pp=2, sp=2)
    for schedule in ("epp", "packed-1f1b", "seq1f1b", "gpipe"):
        default_planner(f"pp2sp2_planner_{schedule}", schedule=schedule, pp=2, sp=2,
                        tie=schedule == "epp")
    bad_input()


if __name__ == "__main__":
    init()
    {"sp2": sp2, "world4": world4}[sys.argv[1]]()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
