"""Shared pieces of the single-GPU benchmarks: models, timed steps, OOM handling, EPP engines.

Design: every measured configuration builds a *fresh* model and optimizer and frees them after,
so one configuration's allocator state (or out-of-memory) never leaks into the next; a step is
timed end to end (forward, backward, optimizer) with device synchronisation, because that is the
number a user's tokens/s comes from.  Everything also runs on CPU with a tiny model, which is how
the scripts are tested without a GPU; the GPU numbers only come from the GPU.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 211, "head_dim": 16,
               "max_position_embeddings": 1 << 20, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}


def load_config(path: str | None, tiny: bool) -> dict:
    if tiny:
        return dict(TINY_CONFIG)
    from infinipipe_hf.models.model_configs import config_path

    p = Path(path) if path else Path(config_path("llama3.2-1b"))
    with open(p) as f:
        return json.load(f)


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    try:
        import flash_attn
        env["flash_attn"] = flash_attn.__version__
    except Exception as exc:
        env["flash_attn"] = f"absent ({type(exc).__name__})"
    return env


def make_model(config: dict, device: torch.device, dtype: torch.dtype, attn: str = "sdpa", seed: int = 0):
    import transformers

    d = dict(config)
    model_type = d.pop("model_type")
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    cfg = transformers.AutoConfig.for_model(model_type, **d)
    cfg.use_cache = False  # training: no KV cache (it would also disable HF's packed-sequence masks)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).train()


def make_optimizer(params, device: torch.device):
    return torch.optim.AdamW(list(params), lr=1e-5, fused=device.type == "cuda")


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_steps(step: Callable[[], object], device: torch.device, tokens: int, *, warmup: int,
                steps: int) -> dict:
    """Run ``warmup`` then ``steps`` steps; median step time, tokens/s and peak memory.

    The peak is ``max_memory_allocated`` over the timed steps, so it includes optimizer states
    (created by the warm-up step) but not the allocator's cached-but-free blocks.
    """
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, last = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        last = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    row = {"tokens": tokens, "step_s": t, "step_times_s": times, "tokens_per_s": tokens / t}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        row["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return row, last


class RowError(Exception):
    """A failure that carries what was known before it (the plan, memory at the failure)."""

    def __init__(self, cause: BaseException, facts: dict):
        super().__init__(str(cause))
        self.cause, self.facts = cause, facts


def memory_at_failure(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_gib_at_failure": torch.cuda.max_memory_allocated(device) / 2**30,
            "reserved_gib_at_failure": torch.cuda.max_memory_reserved(device) / 2**30}


def guarded(name: str, fn: Callable[[], dict], device: torch.device, log=print) -> dict:
    """Run one configuration; out-of-memory and errors become a result row, never a crash."""
    t0 = time.perf_counter()
    try:
        row = fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports every failure and goes on
        facts = exc.facts if isinstance(exc, RowError) else {}
        cause = exc.cause if isinstance(exc, RowError) else exc
        row = {"error": "OOM" if is_oom(cause) else f"{type(cause).__name__}: {str(cause)[:400]}", **facts}
        del exc, cause
    free(device)
    row = {"name": name, **row, "wall_s": time.perf_counter() - t0}
    log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                    if k not in ("step_times_s", "timeline", "plan")}))
    return row


def bench_profile_path(base_profile: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """A profile file for the engine whose model-state bytes match this benchmark's training setup.

    Parameters, gradients and AdamW states all live in ``dtype`` here (pure bf16 training), so
    the states take ``4 * element size`` bytes per parameter, not the mixed-precision default of
    16; the memory budget is the device's memory.  Timing and activation figures are kept.
    """
    from benchmarks.lib.shared_cores import device_profile
    from infinipipe_hf.planner.cost.profile import default_profile

    prof = device_profile(base_profile) if base_profile else default_profile()
    esize = torch.empty((), dtype=dtype).element_size()
    mem = (torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda"
           else prof.memory_gib)
    prof = replace(prof, state_bytes_per_param=4.0 * esize, bytes_per_element=esize, memory_gib=mem)
    import tempfile

    # A scratch file: it is derived, and the results directory holds only results.
    fd, path = tempfile.mkstemp(prefix="bench_profile_", suffix=".json")
    with open(fd, "w") as f:
        json.dump(prof.to_dict(), f)
    return path


class ActionTimer:
    """Per-action device time of an engine step: wraps the runner's forward/backward with events.

    Host clocks around asynchronous CUDA calls measure launches, not work; events recorded on the
    stream measure the work, and are read once after the step (one sync per step, not per action).
    """

    def __init__(self, engine, device: torch.device):
        self.device = device
        self.events: list[tuple[str, object, object]] = []
        runner = engine.runner
        for kind in ("forward", "backward"):
            orig = getattr(runner, kind)

            def wrapped(unit_id, x, _orig=orig, _kind=kind):
                start, end = self._event(), self._event()
                self._record(start)
                out = _orig(unit_id, x)
                self._record(end)
                self.events.append((f"{'F' if _kind == 'forward' else 'B'}{unit_id}", start, end))
                return out

            setattr(runner, kind, wrapped)

    def _event(self):
        return torch.cuda.Event(enable_timing=True) if self.device.type == "cuda" else [0.0]

    def _record(self, ev):
        if self.device.type == "cuda":
            ev.record()
        else:
            ev[0] = time.perf_counter()

    def take(self) -> list[dict]:
        sync(self.device)
        out = []
        for name, s, e in self.events:
            ms = s.elapsed_time(e) if self.device.type == "cuda" else (e[0] - s[0]) * 1e3
            out.append({"action": name, "ms": ms})
        self.events.clear()
        return out
