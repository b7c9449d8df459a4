"""Inputs of the planner CLI: JSON objects, HF model configs, sequence-length lists, cost
profiles, and the planning options its flags set.

Every reader raises a ``ValueError`` naming the file (and line) it cannot use, which the CLI
prints as an input error (exit status 2).
"""
from __future__ import annotations

import json
from pathlib import Path

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.profile import HardwareProfile


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
    """``--profile``: a cost profile JSON written by ``python -m infinipipe_hf.profile``."""
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
            "checkpoint_levels": levels, "sp_rounds": getattr(args, "sp_rounds", None)}
