"""The pipeline settings of the trainer's arguments, derived from ``InfiniPipeConfig``.

Design: ``InfiniPipeConfig`` is the one declaration of the pipeline's settings (type, default,
docstring, checks).  ``PipelineArguments`` is a dataclass generated from its fields at import, so
``EPPTrainingArguments`` (which inherits it) carries every setting with the same type and default,
its docstring as the ``--help`` text, and ``HfArgumentParser`` parses it from the command line.  A
field added to ``InfiniPipeConfig`` appears on the arguments without touching this package;
nothing is declared twice, so nothing can drift.

Two explicit tables say where the Trainer side differs:
- ``RENAMED``: a config field that appears under another name on the arguments;
- ``FROM_TRAINING_ARGUMENTS``: a config field that ``TrainingArguments`` already expresses in its
  own terms (``ddp_timeout`` -> ``p2p_timeout_s``, ``label_smoothing_factor`` ->
  ``label_smoothing``); it gets no second argument, the Trainer's one is mapped.

A config field whose name collides with a ``TrainingArguments`` field and is in neither table is
a ``TypeError`` at import, so a new setting can never silently shadow one of the Trainer's.
Trade-off: the help texts are read from the config's source (``ast``); where the source is not
available (a zipped install) the arguments still work, with the field name as help.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Any, Callable

from transformers import TrainingArguments

from infinipipe_hf.config import InfiniPipeConfig

RENAMED: dict[str, str] = {"schedule": "epp_schedule"}
"""Config field -> argument name (``schedule`` reads as the LR schedule next to the Trainer's)."""

FROM_TRAINING_ARGUMENTS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # A stuck peer surfaces after the same time a stuck DDP collective would.
    "p2p_timeout_s": ("ddp_timeout", float),
    "label_smoothing": ("label_smoothing_factor", float),
    # torch_compile compiles the stage's decoder layers (runtime/stage/compile.py), not the model.
    "compile_layers": ("torch_compile", bool),
    "compile_backend": ("torch_compile_backend", lambda backend: backend or "inductor"),
    "compile_mode": ("torch_compile_mode", lambda mode: mode),
}
"""Config field -> (the ``TrainingArguments`` field it is read from, conversion)."""

AUTO_DEGREES: tuple[str, ...] = ("pp_degree", "sp_degree", "dp_degree")
"""Integer config fields the trainer also accepts as ``"auto"`` (the layout search picks them,
``auto_layout.py``); on the command line they parse with :class:`DegreeOrAuto`."""


class DegreeOrAuto:
    """Command-line type of a parallel degree: an integer, or ``auto`` for the layout search."""

    def __new__(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return int(value)


def field_docstrings(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields carry a string literal after them."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def argument_name(config_field: str) -> str:
    return RENAMED.get(config_field, config_field)


def _as_list_type(tp: Any) -> Any:
    """``tuple[X, ...]`` (and ``tuple[X, ...] | None``) as ``list[X]``: ``HfArgumentParser`` parses
    lists (``nargs="+"``) but would split a tuple-typed value into characters.  The config turns
    the list back into its own type in ``__post_init__``; other types are returned unchanged."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]
    if args and type(None) in args and any(typing.get_origin(a) is tuple for a in args):
        inner = [_as_list_type(a) for a in args if a is not type(None)]
        return inner[0] | None if len(inner) == 1 else tp
    return tp


def pipeline_argument_fields(config_cls: type = InfiniPipeConfig) -> list[tuple[str, Any, Any]]:
    """``make_dataclass`` field specs for every field of ``config_cls`` the arguments carry."""
    hints = typing.get_type_hints(config_cls)
    docs = field_docstrings(config_cls)
    trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    specs = []
    for f in dataclasses.fields(config_cls):
        if f.name in FROM_TRAINING_ARGUMENTS:
            continue
        name = argument_name(f.name)
        if name in trainer_fields:
            raise TypeError(f"{config_cls.__name__}.{f.name} collides with TrainingArguments.{name}; "
                            f"add it to RENAMED or FROM_TRAINING_ARGUMENTS in {__name__}")
        help_text = docs.get(f.name, f.name).replace("%", "%%")  # argparse formats help with %
        kw: dict[str, Any] = {"metadata": {"help": help_text}}
        tp = _as_list_type(hints[f.name])
        if f.name in AUTO_DEGREES:
            tp = DegreeOrAuto | None if type(None) in typing.get_args(tp) else DegreeOrAuto
        if f.default is not dataclasses.MISSING:
            if isinstance(f.default, tuple) and tp is not hints[f.name]:
                kw["default_factory"] = functools.partial(list, f.default)
            else:
                kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default_factory"] = f.default_factory
        specs.append((name, tp, dataclasses.field(**kw)))
    return specs


def config_kwargs(args: Any, config_cls: type = InfiniPipeConfig) -> dict[str, Any]:
    """The ``config_cls`` keyword arguments that ``args`` (a ``PipelineArguments``) describe."""
    kw = {}
    for f in dataclasses.fields(config_cls):
        if f.name in FROM_TRAINING_ARGUMENTS:
            source, convert = FROM_TRAINING_ARGUMENTS[f.name]
            kw[f.name] = convert(getattr(args, source))
        else:
            value = getattr(args, argument_name(f.name))
            kw[f.name] = list(value) if isinstance(value, (list, tuple)) else value
    return kw


def rename_in_message(message: str) -> str:
    """A config error message with config field names replaced by the arguments' names."""
    import re

    for config_name, arg_name in RENAMED.items():
        message = re.sub(rf"(?<![\w.]){config_name}(?=\W|$)", arg_name, message)
    for config_name, (source, _) in FROM_TRAINING_ARGUMENTS.items():
        message = re.sub(rf"(?<![\w.]){config_name}(?=\W|$)", source, message)
    return message


PipelineArguments = dataclasses.make_dataclass("PipelineArguments", pipeline_argument_fields())
PipelineArguments.__module__ = __name__
PipelineArguments.__doc__ = ("Every ``InfiniPipeConfig`` setting as a training argument (generated: "
                             "see the module docstring).")
