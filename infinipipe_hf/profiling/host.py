"""Measurement rows of the host tier: pinned host <-> device copies and the CPU optimizer step.

- ``host_copy`` (CUDA only): ``direction`` (``h2d`` / ``d2h``), ``bytes``, ``ms``, ``bytes_per_s``:
  one copy between a pinned host buffer and device memory, the copy offloaded activations, K/V
  and model states make.  One GPU copies alone here; with every GPU of a node copying at once the
  share each gets can be lower (the fit takes the slower direction).
- ``host_adamw`` (anywhere): ``impl`` (``fused`` / ``foreach``), ``params``, ``tensors``,
  ``threads``, ``local_ranks``, ``ms``, ``params_per_s``: one AdamW step of torch's CPU
  implementation over ``params`` float32 parameters (in ``tensors`` tensors, as a model's layers
  are), with the threads one local rank gets (the host's cores over the ranks that share them),
  what the step of offloaded optimizer states costs.  The first step (which creates the moments)
  is never timed.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable

import torch

from infinipipe_hf.profiling.timer import time_fn

COPY_BYTES = (64 << 20, 256 << 20)
"""Copy sizes measured: large enough that the link's bandwidth, not its latency, decides."""
ADAMW_PARAMS = 1 << 24
"""Parameters of the AdamW row (16M: 256 MiB of weights, gradients and moments)."""
ADAMW_TENSORS = 8


def local_ranks(device: torch.device) -> int:
    """Ranks sharing this host's cores: the launcher's ``LOCAL_WORLD_SIZE``, else the visible CUDA
    devices (one rank each) on CUDA, else 1.  Profiling one GPU of a node whose job runs a rank
    per GPU: set ``LOCAL_WORLD_SIZE`` to the job's ranks per node (``CUDA_VISIBLE_DEVICES`` hides
    the others).  The training job's ranks must get those threads too: ``torchrun`` sets
    ``OMP_NUM_THREADS=1`` unless told otherwise."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env:
        return max(1, int(env))
    return max(1, torch.cuda.device_count()) if device.type == "cuda" else 1


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_copy(nbytes: int, direction: str, device: torch.device, *, warmup: int = 2, repeat: int = 5) -> dict:
    """One pinned host <-> device copy of ``nbytes`` (``direction``: ``h2d`` or ``d2h``)."""
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be h2d or d2h, got {direction!r}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, src = (dev, host) if direction == "h2d" else (host, dev)
    ms = time_fn(lambda: dst.copy_(src, non_blocking=True), device, warmup=warmup, repeat=repeat)
    return {"kind": "host_copy", "direction": direction, "bytes": nbytes, "ms": ms,
            "bytes_per_s": nbytes / (ms * 1e-3)}


def measure_adamw(params: int, impl: str, *, ranks: int = 1, tensors: int = ADAMW_TENSORS,
                  warmup: int = 2, repeat: int = 5) -> dict:
    """One CPU AdamW step over ``params`` float32 parameters with this rank's share of the cores."""
    if impl not in ("fused", "foreach"):
        raise ValueError(f"impl must be fused or foreach, got {impl!r}")
    if params < tensors:
        raise ValueError(f"the AdamW row needs at least {tensors} parameters, got {params}")
    n_threads = max(1, host_cores() // ranks)
    g = torch.Generator().manual_seed(params)
    sizes = [params // tensors + (i < params % tensors) for i in range(tensors)]
    weights = [torch.randn(n, generator=g).requires_grad_(True) for n in sizes]
    for w in weights:
        w.grad = torch.randn(w.shape, generator=g) * 1e-3
    opt = torch.optim.AdamW(weights, lr=1e-4, **{impl: True})
    cpu = torch.device("cpu")
    with threads(n_threads):
        opt.step()  # creates the moments: not the steady-state cost
        ms = time_fn(opt.step, cpu, warmup=warmup, repeat=repeat)
    return {"kind": "host_adamw", "impl": impl, "params": params, "tensors": tensors, "threads": n_threads,
            "local_ranks": ranks, "ms": ms, "params_per_s": params / (ms * 1e-3)}


def host_rows(device: torch.device, *, adamw_params: int = ADAMW_PARAMS, copy_bytes=COPY_BYTES,
              warmup: int = 2, repeat: int = 5, log: Callable[[str], None] = print) -> list[dict]:
    """The host tier's rows: copies on CUDA (skipped with a note elsewhere), AdamW anywhere."""
    rows: list[dict] = []
    if device.type == "cuda":
        for nbytes in copy_bytes:
            for direction in ("h2d", "d2h"):
                row = measure_copy(nbytes, direction, device, warmup=warmup, repeat=repeat)
                log(f"  host copy {direction} {nbytes >> 20} MiB: {row['bytes_per_s'] / 1e9:.1f} GB/s")
                rows.append(row)
    else:
        log(f"  host copy: skipped on {device.type} (pinned host <-> device copies need CUDA); the "
            f"profile keeps host_bandwidth_bytes_per_s's default")
    ranks = local_ranks(device)
    for impl in ("fused", "foreach"):
        row = measure_adamw(adamw_params, impl, ranks=ranks, warmup=warmup, repeat=repeat)
        log(f"  host AdamW ({impl}, {row['threads']} threads, {ranks} local rank(s)): "
            f"{row['params_per_s'] / 1e9:.2f} G parameters/s")
        rows.append(row)
    return rows
