"""The engine's own planner with a host tier (world 1, pp 1, no process group): under a device
budget that whole-layer recompute alone barely meets, the planner offloads layer inputs; the step
is exact against the unsplit float64 model and the host tier's peak is the plan's predicted host
peak (scaled from the profile's element size to the model's).  With ``host_memory_gib=0`` nothing is offloaded at any budget."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf import InfiniPipeConfig, PipelineEngine  # noqa: E402
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model  # noqa: E402

LENGTHS = [700, 130, 90, 60, 300, 20]
BUDGETS_GIB = [0.0021 - 0.00002 * i for i in range(16)]  # from comfortable to infeasible


def offloaded(plan) -> int:
    return sum(per.get("offload", 0) for st in plan.checkpoint_levels.values() for per in st.values())


def first_offloading_plan(host_gib: float):
    """``(engine, plan)`` of the first budget (largest first) whose plan offloads, else ``None``;
    also the number of feasible plans seen."""
    feasible = 0
    for gib in BUDGETS_GIB:
        cfg = InfiniPipeConfig(max_tokens_per_unit=256, memory_budget_gib=gib, host_memory_gib=host_gib)
        engine = PipelineEngine(tiny_model("llama"), cfg)
        try:
            plan, _ = engine.make_plan(LENGTHS)
        except ValueError:
            continue
        feasible += 1
        if offloaded(plan) or plan.offload_kv:
            return engine, plan, feasible
    return None, None, feasible


def test_default_planner_offloads_under_a_tight_budget_and_stays_exact():
    batch = random_batch(LENGTHS, seed=41, with_labels=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, plan, _ = first_offloading_plan(host_gib=1.0)
        assert plan is not None, f"no budget in {BUDGETS_GIB} GiB made the planner offload"
        out = engine.train_step(batch, plan=plan)
        ref = tiny_model("llama")
        want_loss, want = reference_loss_and_grads(ref, batch)
    assert out.loss == pytest.approx(want_loss, rel=1e-10)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, want)
    # The default profile prices activations at its own element size (bf16); the model is float64.
    predicted = plan.info["host_peak_memory_bytes"] * 8 / engine.default_planner.profile.bytes_per_element
    stats = engine.host_tier.stats
    assert predicted > 0 and stats.bytes_out == stats.bytes_in > 0 and stats.current_bytes == 0
    assert abs(stats.peak_bytes - predicted) <= 0.05 * predicted, (stats.peak_bytes, predicted)


def test_no_host_tier_no_offload():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, plan, feasible = first_offloading_plan(host_gib=0.0)
    assert plan is None and feasible > 0


def test_one_rank_with_every_state_in_host_memory():
    """``state_offload='states'`` on one rank (no process group: the engine starts a one-rank one
    for FSDP2's CPU offload): exact gradients and AdamW step, every state on the host."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from infinipipe_hf.runtime.parallel.fsdp_api import full_tensor, local_tensor
    from tests.distributed.plans import make_plan

    ours = not dist.is_initialized()  # the engine starts a one-rank group: leave none behind
    batch = random_batch([37, 11, 8], seed=3, with_labels=True)
    units = [[[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37), (1, 0, 11)], [(2, 0, 8)]]]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PipelineEngine(tiny_model("llama"), InfiniPipeConfig(state_offload="states"))
            plan = make_plan([37, 11, 8], units, 1, engine.layers_per_stage, lambda s, u, n: u % (n + 1))
            out = engine.train_step(batch, plan=plan)
            ref = tiny_model("llama")
            want_loss, want = reference_loss_and_grads(ref, batch)
        assert dist.get_world_size() == 1
        policies = {type(fully_shard.state(m)._fsdp_param_group.offload_policy) for m in engine.sharding.modules}
        assert policies == {CPUOffloadPolicy}, policies
        assert out.loss == pytest.approx(want_loss, rel=1e-10)
        assert_grads_close({n: full_tensor(p.grad) for n, p in engine.named_parameters()}, want)
        opt = torch.optim.AdamW(list(engine.parameters()), lr=1e-2)
        opt.step()
        torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
        weights = dict(ref.named_parameters())
        for n, p in engine.named_parameters():
            assert local_tensor(p).device.type == "cpu"
            assert torch.allclose(full_tensor(p.detach()), weights[n], rtol=1e-10, atol=1e-12), n
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
