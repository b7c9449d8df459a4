"""An offline conversational dataset for SFT demos: questions about the standard library, answered
by its own docstrings.

Design: for public functions and classes of a fixed list of pure-Python standard-library modules,
the user asks what ``module.name`` does and the assistant answers with the docstring's first
paragraph (whitespace normalised).  It needs no download and no network, exercises the
conversational path of TRL's data preparation (chat template, assistant-only loss), and answers
vary in length from one line to a paragraph, so the batches are uneven the way real SFT data is.

Trade-off: the contents follow the running Python's docstrings, so they differ between Python
versions; callers (and tests) rely on the format, never on exact texts or counts.
"""
from __future__ import annotations

import importlib
import inspect

MODULES = ("textwrap", "string", "json", "csv", "fractions", "statistics", "heapq", "bisect",
           "difflib", "shlex", "fnmatch", "glob", "posixpath", "calendar", "base64", "html",
           "ipaddress", "pprint", "copy", "functools", "itertools", "collections", "random",
           "datetime", "decimal", "zipfile", "tarfile", "gzip", "logging", "argparse")
"""Modules asked about, in this order (pure-Python ones have docstrings on every public name)."""

MIN_ANSWER_CHARS = 20


def _first_paragraph(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(para.split())


def stdlib_conversations(n: int | None = None, *, system: str | None = None) -> list[list[dict]]:
    """Up to ``n`` conversations ``[{"role": "user", ...}, {"role": "assistant", ...}]`` (all if
    ``None``), deterministic for a given Python; ``system`` prepends a system turn."""
    if n is not None and n < 1:
        raise ValueError(f"n must be a positive number of conversations or None, got {n}")
    out: list[list[dict]] = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            if name.startswith("_"):
                continue
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not obj.__doc__:
                continue
            answer = _first_paragraph(obj.__doc__)
            if len(answer) < MIN_ANSWER_CHARS:
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            turns = [{"role": "user", "content": f"What does the {kind} {module_name}.{name} do?"},
                     {"role": "assistant", "content": answer}]
            out.append(([{"role": "system", "content": system}] if system else []) + turns)
            if n is not None and len(out) == n:
                return out
    return out
