"""Measure this machine's costs for one model and fit them into a ``HardwareProfile``.

Times one decoder layer of the model (transformers' own layer class, random weights) forward and
forward+backward at several sequence lengths, its saved activation bytes and forward peak per
token, and the final norm + LM head + loss at several token counts, and the host tier (pinned
copies on CUDA, the CPU AdamW step anywhere: :mod:`.host`), then fits them.  Profiling the
*target* model's layer (not a reference layer rescaled by FLOPs) is what makes the cost model exact
for that model.  Without CUDA it refuses (CPU timings would mislead a GPU planner) unless asked for
``device="cpu"``, a smoke mode for tests and for planning CPU runs.
"""
from __future__ import annotations

import dataclasses
import platform

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_HEAD_TOKENS = (1024, 2048, 4096, 8192)


def environment(device) -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "device_type": device.type}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for name in ("flash_attn", "triton"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # absent or broken: record why, the fit does not need it
            env[name] = f"absent ({type(exc).__name__})"
    return env


def resolve_device(name: str):
    import torch

    if name in ("auto", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is visible (torch {torch.__version__}, "
                             f"cuda available: False). Profile on the GPU you will train on, or pass "
                             f"--device cpu for a CPU smoke profile (not valid for planning GPU runs)")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"--device must be auto, cuda or cpu, got {name!r}")


def run_profile(config_dict: dict, *, device: str = "auto", dtype: str = "bf16",
                lengths=DEFAULT_LENGTHS, head_tokens=DEFAULT_HEAD_TOKENS, slice_attention=(),
                warmup: int = 2, repeat: int = 5, name: str | None = None, log=print,
                host_adamw_params: int | None = None, attention_tokens=None, attention_budget_s: float = 15.0,
                compile_layers: bool = False, calibrate: bool = True):
    """Measure and fit: ``(HardwareProfile, rows_document)``.  ``host_adamw_params``: the CPU AdamW
    row's parameters (default :data:`~.host.ADAMW_PARAMS`); ``attention_tokens``: the backend table's
    token counts (``None``: its defaults; empty: none); ``calibrate=False``: a GPU fit stays ideal
    (simulator checks need the layer speed alone, not the shipped whole-step efficiency)."""
    import torch

    from infinipipe_hf.planner.cost.profile import fit_profile, shipped_calibration
    from infinipipe_hf.profiling.host import ADAMW_PARAMS, host_rows
    from infinipipe_hf.profiling.measure import profile_rows
    from infinipipe_hf.profiling.modules import build_modules, reference_shape

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    lengths = sorted(set(int(n) for n in lengths))
    head_tokens = sorted(set(int(n) for n in head_tokens))
    if len(lengths) < 3 or len(head_tokens) < 2:
        raise ValueError(f"the fit needs >= 3 --lengths and >= 2 --head-tokens, got {lengths} and {head_tokens}")
    dev = resolve_device(device)
    tdtype = getattr(torch, DTYPES[dtype])
    modules = build_modules(config_dict, dev, tdtype)
    if compile_layers:  # the layer as a compile_layers stage runs it (runtime/stage/compile.py)
        from infinipipe_hf.runtime.stage.compile import compile_profiled_layer

        compile_profiled_layer(modules.layer, modules.config)
    env = environment(dev)
    log(f"profiling one {type(modules.layer).__name__} ({modules.spec.hidden_size} hidden) in {dtype} "
        f"on {env.get('gpu', dev.type)}")
    rows = profile_rows(modules, lengths, head_tokens, slice_attention, dev, tdtype, warmup=warmup,
                        repeat=repeat, log=log)
    rows += host_rows(dev, adamw_params=host_adamw_params or ADAMW_PARAMS, warmup=warmup, repeat=repeat, log=log)
    memory_gib = (torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda"
                  else 0.0)
    reference = reference_shape(modules.spec)
    name = name or f"{env.get('gpu', 'cpu').replace(' ', '-').lower()}-{dtype}-{modules.spec.model_type}"
    doc = {"name": name, "source": "python -m infinipipe_hf.profile", "device": env.get("gpu", "cpu"),
           "dtype": DTYPES[dtype], "memory_gib": memory_gib, "env": env, "reference": reference,
           "rows": rows, "compile_layers": bool(compile_layers)}
    if dev.type != "cuda":
        doc["notes"] = ["host_copy rows skipped: pinned host <-> device copies need CUDA "
                        "(host_bandwidth_bytes_per_s keeps its default)"]
    # On a GPU the fit takes the shipped calibration: EPP's measured whole-step efficiency and the
    # alternatives' (docs/calibration.md); a CPU fit prices the runtime's own steps and stays ideal.
    profile = fit_profile(rows, reference, name=name, memory_gib=memory_gib or 80.0,
                          device=doc["device"], meta={"env": env, "source": doc["source"], "rows": rows},
                          calibration=shipped_calibration() if calibrate and dev.type == "cuda" else None)
    bpe = torch.empty((), dtype=tdtype).element_size()
    from infinipipe_hf.profiling.attention_backends import attention_table
    spec = modules.spec
    doc["attention_backends"] = {} if attention_tokens is not None and not attention_tokens else attention_table(
        spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, dev, tdtype, tokens=attention_tokens,
        warmup=warmup, repeat=repeat, budget_s=attention_budget_s, log=log)
    from infinipipe_hf.runtime.attention.select import context_pairs
    profile = dataclasses.replace(profile, bytes_per_element=bpe, attention_backends=doc["attention_backends"],
                                  context_pairs=context_pairs(dev, doc["attention_backends"]))
    return profile, doc
