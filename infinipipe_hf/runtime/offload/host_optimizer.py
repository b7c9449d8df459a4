"""``HostOptimizer``: a stage's optimizer states in host memory and its step on the CPU
(``state_offload='optimizer'``).

Design: the wrapped optimizer (the one HF's ``Trainer`` created, e.g. ``torch.optim.AdamW``) is
re-pointed at host *master* copies of the stage's parameters (float32, or the parameter's dtype
when wider; pinned on CUDA), so its moments are created on the host too.  A step copies each
gradient down into its master's ``.grad``, runs the wrapped optimizer's own step on the CPU and
copies the updated masters up into the device parameters; gradients land in one host buffer per
parameter (pinned on CUDA, so the copies down run asynchronously), kept between steps.  The device keeps weights and
gradients only.  Same arithmetic as the plain optimizer on the same dtype, so float64 runs match
it exactly; with low-precision weights the masters keep the float32 values the device rounds.

Sharded parameters (``DTensor`` s) work too: masters are copies of the local shard (the update is
elementwise).  ``state_dict`` is the wrapped optimizer's (host tensors) plus the masters when they
are wider than the weights, so a resume continues from the same float32 values; with equal
dtypes the masters are taken again from the (restored) weights.  Host bytes are reported to the
stage's :class:`~.host_tier.HostTier` after every step and load.
"""
from __future__ import annotations

import contextlib
import os

import torch

from infinipipe_hf.runtime.offload.host_tier import HostTier

MASTERS_KEY = "host_masters"


def host_step_threads() -> int:
    """CPU threads one local rank's host step may use: the cores it can run on over the local ranks
    (``torchrun`` sets ``OMP_NUM_THREADS=1`` for the training loop, which would run AdamW on one core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


@contextlib.contextmanager
def host_threads(active: bool):
    """Run the block with :func:`host_step_threads` threads when ``active`` (the step runs beside a
    GPU, whose loop leaves the cores idle), then restore torch's thread count."""
    before = torch.get_num_threads()
    if active:
        torch.set_num_threads(max(before, host_step_threads()))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _local(t: torch.Tensor) -> torch.Tensor:
    from infinipipe_hf.runtime.parallel.fsdp_api import local_tensor

    return local_tensor(t)


class HostOptimizer(torch.optim.Optimizer):
    """``optimizer`` with its parameters' masters and states in host memory (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, tier: HostTier | None = None) -> None:
        if isinstance(optimizer, HostOptimizer):
            raise ValueError("the optimizer is already a HostOptimizer")
        if any(optimizer.state.values()):
            raise ValueError("wrap the optimizer before its first step: it already holds states on the device")
        self.optimizer = optimizer
        self.tier = tier if tier is not None else HostTier()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device parameter, host master)
        self._grads: list[torch.Tensor] = []  # a host buffer per master its gradient is copied into
        self.param_groups = []
        """The device parameters' groups (what schedulers and gradient code see); their settings
        (``lr``...) are copied to the wrapped optimizer's host groups before each step."""
        for group in optimizer.param_groups:
            masters = [self._master(p) for p in group["params"]]
            self._pairs += list(zip(group["params"], masters))
            self._grads += [torch.empty_like(m, pin_memory=m.is_pinned()) for m in masters]
            self.param_groups.append(dict(group))
            group["params"] = masters
        self._account()

    @staticmethod
    def _master(p: torch.Tensor) -> torch.Tensor:
        local = _local(p).detach()
        dtype = local.dtype if not local.is_floating_point() or local.element_size() >= 4 else torch.float32
        m = torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=local.is_cuda)
        m.copy_(local)
        return m.requires_grad_(p.requires_grad)

    # --- what the Trainer and LR schedulers read ------------------------------------------
    def _sync_settings(self, to_host: bool = True) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            src, dst = (outer, inner) if to_host else (inner, outer)
            dst.update({k: v for k, v in src.items() if k != "params"})

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"HostOptimizer({self.optimizer!r})"

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("HostOptimizer cannot take new parameter groups; build the optimizer with all "
                         "of them before wrapping it")

    # --- the step ------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self._pairs:
            m.grad = None
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostOptimizer.step takes no closure (the step runs on host copies)")
        for (p, m), buf in zip(self._pairs, self._grads):  # gradients down
            m.grad = None if p.grad is None else buf.copy_(_local(p.grad), non_blocking=m.is_pinned())
        beside_gpu = any(m.is_pinned() for _, m in self._pairs)
        if beside_gpu:
            torch.cuda.synchronize()  # gradients landed; the last step's copies up read their masters
        self._sync_settings()
        with host_threads(beside_gpu):
            self.optimizer.step()
        for p, m in self._pairs:  # weights up
            if m.grad is not None:
                _local(p).copy_(m, non_blocking=m.is_pinned())
                m.grad = None
        self._account()

    # --- checkpoints ----------------------------------------------------------------------
    def _widened(self) -> bool:
        return any(m.dtype != _local(p).dtype for p, m in self._pairs)

    def state_dict(self) -> dict:
        self._sync_settings()
        sd = self.optimizer.state_dict()
        if self._widened():
            sd[MASTERS_KEY] = [m.detach().clone() for _, m in self._pairs]
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        if any(m.is_pinned() for _, m in self._pairs):
            torch.cuda.synchronize()  # no copy up may still read a master this overwrites
        sd = dict(state_dict)
        masters = sd.pop(MASTERS_KEY, None)
        self.optimizer.load_state_dict(sd)  # moves the states onto the masters' (host) device
        self._sync_settings(to_host=False)
        if masters is not None and len(masters) != len(self._pairs):
            raise ValueError(f"the checkpoint holds {len(masters)} master weights for {len(self._pairs)} "
                             f"parameters; resume with the model and layout it was saved with")
        for i, (p, m) in enumerate(self._pairs):
            m.copy_(masters[i] if masters is not None else _local(p))
        self._account()

    def host_bytes(self) -> int:
        """Bytes of the masters, their gradient buffers and the states on the host."""
        n = 2 * sum(m.numel() * m.element_size() for _, m in self._pairs)
        for st in self.optimizer.state.values():
            n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
        return n

    def _account(self) -> None:
        self.tier.set_resident("optimizer", self.host_bytes())


def offload_optimizer(optimizer: torch.optim.Optimizer, dims, tier: HostTier | None = None) -> torch.optim.Optimizer:
    """``optimizer`` as the layout's state offload wants it: wrapped in a :class:`HostOptimizer`
    under ``state_offload='optimizer'`` (once), else unchanged (under ``'states'`` FSDP2 keeps the
    parameters, and so the optimizer's states, in host memory already)."""
    mode = dims.state_offload
    if mode.optimizer_on_host and not mode.weights_on_host and not isinstance(optimizer, HostOptimizer):
        return HostOptimizer(optimizer, tier)
    return optimizer
