"""The host tier on CUDA: pinned host copies on a side stream, prefetched back; an engine step with
``offload`` layers, ``offload_kv`` and the host optimizer equals the unsplit float64 model on the
same device.  CUDA only (``DEVICE`` is a module constant so the logic can be dry-run on CPU)."""
import copy

import pytest
import torch

from infinipipe_hf import InfiniPipeConfig, PipelineEngine
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.runtime.offload.host_optimizer import offload_optimizer
from infinipipe_hf.runtime.offload.host_tier import HostTier
from tests.distributed.plans import make_plan
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICE = "cuda"

LENGTHS = [37, 11, 8, 5]
UNITS = [[[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37), (1, 0, 11)], [(2, 0, 8), (3, 0, 5)]]]


def test_tier_round_trip_pinned_and_prefetched():
    tier = HostTier()
    t = torch.randn(64, 32, device=DEVICE)
    h = tier.put(t * 1, tag=1)
    assert h.host.device.type == "cpu" and (h.host.is_pinned() or DEVICE == "cpu")
    tier.prefetch_tag(1)
    back = tier.get(h)
    assert back.device == t.device and torch.equal(back, t)
    h2 = tier.put(t, tag=2)
    for _ in range(2):  # kept: read twice, each time brought back
        assert torch.equal(tier.get(h2, keep=True), t)
    tier.release(h2)
    s = tier.stats
    assert (s.bytes_out, s.bytes_in, s.current_bytes) == (2 * t.numel() * 4, 3 * t.numel() * 4, 0)


def test_engine_step_with_offload_kv_and_host_optimizer_matches_the_model():
    ref = tiny_model("llama", num_layers=4, seed=3).to(DEVICE)
    cfg = InfiniPipeConfig(state_offload="optimizer", loss_chunk_tokens=8)
    engine = PipelineEngine(copy.deepcopy(ref), cfg, device=DEVICE)
    lps = engine.layers_per_stage
    plan = make_plan(LENGTHS, UNITS, 1, lps, checkpoint=lambda s, u, n: u % 2)
    for u in plan.units:
        plan.checkpoint_levels.setdefault(0, {})[u.id] = CheckpointMix(offload=1 + u.id % 2).finer
    plan.offload_kv = [0]
    opt_kw = dict(lr=1e-2, weight_decay=0.1)
    opt = offload_optimizer(torch.optim.AdamW(list(engine.parameters()), **opt_kw), engine.layout.dims,
                            engine.host_tier)
    ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kw)
    for step in range(2):
        batch = random_batch(LENGTHS, seed=step, with_labels=True)
        want_loss, want = reference_loss_and_grads(ref, batch)
        out = engine.train_step(batch, plan=plan)
        assert out.loss == pytest.approx(want_loss, rel=1e-10)
        got = {n: p.grad.cpu() for n, p in engine.named_parameters()}
        assert_grads_close(got, {n: g.cpu() for n, g in want.items()}, rtol=1e-9)
        s = engine.host_tier.stats
        assert s.copies_out > 0 and s.copies_in >= s.copies_out
        ref_opt.step()
        opt.step()
        ref.zero_grad(set_to_none=True)
        opt.zero_grad()
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # the last copies up of the host optimizer
    weights = dict(ref.named_parameters())
    for n, p in engine.named_parameters():
        w = weights[n]
        assert (p.detach() - w).abs().max().item() <= 1e-9 * w.abs().max().item(), n
