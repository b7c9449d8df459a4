"""Inputs of the planner CLI: JSON objects, HF model configs, sequence-length lists, cost
profiles, the planning options its flags set, and the memory budget (the trainer's rule).

Every reader raises a ``ValueError`` naming the file (and line) it cannot use, which the CLI
prints as an input error (exit status 2).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

from infinipipe_hf.config import GIB, InfiniPipeConfig, MemoryBudget, planning_budget
from infinipipe_hf.ir.levels import FINER_LEVELS, check_solver_time_limit
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout.state_offload import STATE_OFFLOADS, state_offload
from infinipipe_hf.planner.cost.profile import PROFILE_NAMES, HardwareProfile


def _read_text(path: str, what: str) -> str:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{what} {path} does not exist")
    if p.is_dir():
        raise ValueError(f"{what} {path} is a directory; pass a file")
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


def read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``; a ValueError naming the file (and line) when it is not one."""
    try:
        data = json.loads(_read_text(path, what))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got a {type(data).__name__}")
    return data


def read_model_spec(path: str) -> ModelSpec:
    """``--model``: an HF ``config.json``, or a checkpoint directory holding one."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json; pass an HF config.json or a "
                             f"checkpoint directory that holds one")
        p = p / "config.json"
    cfg = read_json(str(p), "model config")
    try:
        return ModelSpec.from_config_dict(cfg)
    except KeyError as exc:
        raise ValueError(f"model config {p} lacks {exc.args[0]!r}; is it an HF config.json of a "
                         f"decoder-only model?") from None
    except ValueError as exc:
        raise ValueError(f"model config {p}: {exc}") from None


def read_lengths(path: str) -> list[int]:
    """``--lengths``: one integer per line; blank lines and ``#`` comments are skipped."""
    text = _read_text(path, "lengths file")
    lengths = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            lengths.append(int(line))
        except ValueError:
            raise ValueError(f"{path}:{lineno}: expected one integer sequence length per line, got {line!r}") from None
    return lengths


def read_profile(path: str) -> HardwareProfile:
    """``--profile``: a cost profile JSON written by ``python -m infinipipe_hf.profile``, or a shipped
    profile by name (``uncalibrated``, ``default``)."""
    if path in PROFILE_NAMES:
        return HardwareProfile.load(path)
    data = read_json(path, "profile")
    try:
        return HardwareProfile.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile {path} is not a usable cost profile ({type(exc).__name__}: "
                         f"{exc}); write one with python -m infinipipe_hf.profile") from None


def plan_options(args) -> dict:
    """The keyword arguments of ``plan_step`` the CLI's flags set beside the layout and schedule
    (one place, so a single plan and the layout search plan alike)."""
    levels = () if args.checkpoint_levels.strip() in ("", "none") else tuple(
        lv.strip() for lv in args.checkpoint_levels.split(","))
    return {"max_tokens_per_unit": args.max_tokens_per_unit, "checkpointing": args.checkpointing,
            "checkpoint_levels": levels, "sp_rounds": getattr(args, "sp_rounds", None),
            "grad_reduce": getattr(args, "grad_reduce", "auto"),
            "adopt_rounds_of": tuple(n.strip() for n in getattr(args, "adopt_rounds_of", "").split(",") if n.strip()),
            "solver_time_limit_s": check_solver_time_limit(getattr(args, "solver_time_limit_s", 0.0),
                                                           "--solver-time-limit-s")}


def add_memory_arguments(p) -> None:
    """The memory flags: the device's memory and the trainer's margin and reserve, or a budget."""
    defaults = {f.name: f.default for f in dataclasses.fields(InfiniPipeConfig)}
    p.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="memory of one GPU in GiB, as torch reports it (an H100 80GB reports 79.2); the plan "
                        "stays under it less --memory-margin and --memory-reserve-gib, as the trainer's does")
    p.add_argument("--memory-margin", type=float, default=defaults["memory_margin"],
                   help="share of the GPU's memory held back for the memory model's error (InfiniPipeConfig."
                        "memory_margin, default %(default)s)")
    p.add_argument("--memory-reserve-gib", type=float, default=defaults["memory_reserve_gib"],
                   help="GiB held back for the allocator, CUDA context and communication buffers "
                        "(InfiniPipeConfig.memory_reserve_gib, default %(default)s)")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="plan to exactly this many GiB per GPU instead (InfiniPipeConfig.memory_budget_gib)")


def add_host_arguments(p) -> None:
    """The host tier's flags: host memory per GPU and where the model states live."""
    p.add_argument("--host-memory-gib", type=float, default=0.0,
                   help="host (CPU) memory per GPU the plan may use, in GiB, exactly (no margin): optimizer "
                        "states, offloaded layer inputs and K/V. Default 0: no host tier, since the planner "
                        "plans for a machine it does not see (the trainer's default is the machine's RAM over "
                        "its local ranks); a DGX H100 has 2 TiB over 8 GPUs: 256")
    p.add_argument("--state-offload", default=None, choices=STATE_OFFLOADS,
                   help="model states in host memory: none, optimizer (AdamW moments and fp32 masters, the step "
                        "on the CPU) or states (weights and gradients too); needs --host-memory-gib > 0. Default "
                        "none; with --search-layout: searched like a shard mode when --host-memory-gib > 0, or "
                        "only this mode")


def host_budget_bytes(args) -> float:
    """``--host-memory-gib`` in bytes (0: no host tier), checked against ``--state-offload``."""
    host = args.host_memory_gib
    if not host >= 0:
        raise ValueError(f"--host-memory-gib must be >= 0 (host memory per GPU in GiB; 0: no host tier), got {host}")
    mode = args.state_offload
    if host == 0 and mode is not None and state_offload(mode).offloaded:
        raise ValueError(f"--state-offload {mode} keeps model states in host memory, but --host-memory-gib is 0 (no "
                         f"host tier); give the host memory per GPU (e.g. --host-memory-gib 256 on a DGX H100) or "
                         f"drop --state-offload")
    return host * GIB


def host_note(host_bytes: float) -> str | None:
    """The table's line when the plan has no host tier (None when it has one)."""
    if host_bytes > 0:
        return None
    return ("host memory: none planned (--host-memory-gib 0: the planner does not see the machine's host memory; "
            "give it per GPU to let the plan offload optimizer states, layer inputs and K/V)")


def host_flags(args) -> str:
    """The host flags given, for a command that plans alike."""
    out = [f"--host-memory-gib {args.host_memory_gib:g}"] if args.host_memory_gib else []
    return " ".join(out)


def memory_budget(args) -> MemoryBudget:
    """The budget the flags plan to: the trainer's rule (``InfiniPipeConfig.memory_budget``)."""
    if not args.gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be > 0 (the GPU's memory in GiB), got {args.gpu_memory_gib}")
    budget = planning_budget(args.gpu_memory_gib * GIB, args.memory_margin, args.memory_reserve_gib,
                             args.memory_budget_gib)
    if budget.explicit and budget.budget_bytes > budget.device_memory_bytes:
        print(f"warning: --memory-budget-gib {args.memory_budget_gib:g} is more than the GPU's "
              f"--gpu-memory-gib {args.gpu_memory_gib:g}", file=sys.stderr)
    return budget


def memory_flags(args) -> str:
    """The memory flags as given, for a command that plans to the same budget."""
    if args.memory_budget_gib is not None:
        return f"--memory-budget-gib {args.memory_budget_gib!r}"
    defaults = {f.name: f.default for f in dataclasses.fields(InfiniPipeConfig)}
    out = f"--gpu-memory-gib {args.gpu_memory_gib:g}"
    if args.memory_margin != defaults["memory_margin"]:
        out += f" --memory-margin {args.memory_margin!r}"
    if args.memory_reserve_gib != defaults["memory_reserve_gib"]:
        out += f" --memory-reserve-gib {args.memory_reserve_gib!r}"
    return out


def length_warnings(spec: ModelSpec, lengths: list[int]) -> list[str]:
    """Warnings for sequences longer than the model's ``max_position_embeddings`` (the trainer
    would not run them whole), each saying what to change."""
    limit = spec.max_position_embeddings
    over = [n for n in lengths if n > limit] if limit else []
    if not over:
        return []
    return [f"{len(over)} of {len(lengths)} sequences (longest {max(over)} tokens) are longer than the model's "
            f"max_position_embeddings={limit}: the trainer would cut such documents into pieces of at most {limit} "
            f"tokens (long_document_policy='split', the default) or refuse them ('reject'), so it would not run "
            f"this plan; plan lengths of at most {limit}, or use a model config with longer positions (e.g. "
            f"infinipipe_hf/models/configs/llama3.1-8b.json, 131072)"]


def plan_option_flags(args) -> str:
    """The planning flags given besides their defaults, for a command that plans alike."""
    out = [f"--profile {shlex.quote(args.profile)}"] if args.profile else []
    if args.max_tokens_per_unit is not None:
        out.append(f"--max-tokens-per-unit {args.max_tokens_per_unit}")
    if args.checkpointing != "adaptive":
        out.append(f"--checkpointing {args.checkpointing}")
    if plan_options(args)["checkpoint_levels"] != FINER_LEVELS:
        out.append(f"--checkpoint-levels {shlex.quote(args.checkpoint_levels)}")
    if getattr(args, "sp_rounds", None) is not None:
        out.append("--sp-rounds" if args.sp_rounds else "--no-sp-rounds")
    if getattr(args, "grad_reduce", "auto") != "auto":
        out.append(f"--grad-reduce {args.grad_reduce}")
    if getattr(args, "adopt_rounds_of", ""):
        out.append(f"--adopt-rounds-of {shlex.quote(args.adopt_rounds_of)}")
    if getattr(args, "solver_time_limit_s", 0.0):
        out.append(f"--solver-time-limit-s {args.solver_time_limit_s!r}")
    return " ".join(out)
