"""``HostOptimizer`` (runtime/offload/host_optimizer.py): AdamW states on the host, step on the CPU.

Against the plain optimizer on the same float64 model: identical weights after several steps with
a learning-rate schedule and a skipped (dropped-gradient) step, states and masters on the host and
counted by the tier, and a save + load into a fresh wrapper continues exactly.
"""
import copy

import pytest
import torch

from infinipipe_hf.runtime.offload.host_optimizer import MASTERS_KEY, HostOptimizer
from infinipipe_hf.runtime.offload.host_tier import HostTier


def model_and_data(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)
    xs = [torch.randn(4, 6, dtype=dtype) for _ in range(5)]
    return model, xs


def train(model, opt, sched, xs, skip=()):
    for i, x in enumerate(xs):
        model(x).pow(2).sum().backward()
        if i in skip:  # what the trainer's non-finite guard does: drop the step's gradients
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad = None
        opt.step()
        sched.step()
        opt.zero_grad()


def make(model, host: bool, tier=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if host:
        opt = HostOptimizer(opt, tier)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def test_same_weights_as_the_plain_optimizer_and_states_on_the_host():
    plain, xs = model_and_data()
    hosted = copy.deepcopy(plain)
    train(plain, *make(plain, False), xs, skip=(2,))
    tier = HostTier()
    opt, sched = make(hosted, True, tier)
    train(hosted, opt, sched, xs, skip=(2,))
    for a, b in zip(plain.parameters(), hosted.parameters()):
        assert torch.equal(a, b)
    states = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
    assert states and all(t.device.type == "cpu" for t in states)
    assert all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for p, (_, m) in zip(hosted.parameters(), opt._pairs) for t in (m,))
    params = sum(p.numel() for p in hosted.parameters())
    # a float64 master, its gradient buffer and two moments per weight, a float32 step count per tensor
    assert tier.stats.resident["optimizer"] == opt.host_bytes() == 4 * params * 8 + 4 * 4
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 6)


def test_save_and_resume_continue_exactly():
    model, xs = model_and_data(1)
    opt, sched = make(model, True)
    train(model, opt, sched, xs[:2])
    saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()), copy.deepcopy(model.state_dict())
    train(model, opt, sched, xs[2:])
    resumed, _ = model_and_data(7)
    resumed.load_state_dict(saved[2])
    opt2, sched2 = make(resumed, True)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    train(resumed, opt2, sched2, xs[2:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert MASTERS_KEY not in saved[0]  # float64 weights are their own masters


def test_low_precision_weights_keep_float32_masters_across_a_resume():
    model, xs = model_and_data(2, torch.bfloat16)
    opt, sched = make(model, True)
    assert all(m.dtype == torch.float32 for _, m in opt._pairs)
    train(model, opt, sched, xs[:2])
    sd = opt.state_dict()
    assert len(sd[MASTERS_KEY]) == 4
    fresh, _ = model_and_data(2, torch.bfloat16)
    opt2, _ = make(fresh, True)
    opt2.load_state_dict(copy.deepcopy(sd))
    assert all(torch.equal(m1, m2) for (_, m1), (_, m2) in zip(opt._pairs, opt2._pairs))


def test_refuses_an_optimizer_that_already_stepped():
    model, xs = model_and_data()
    opt = torch.optim.AdamW(model.parameters())
    model(xs[0]).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="before its first step"):
        HostOptimizer(opt)
