"""Warnings and info lines of a multi-process job: once, from rank 0, pointing at the user's code.

Design: every rank runs the same script, so a plain ``warnings.warn`` prints once per rank, and a
``stacklevel`` counted by hand points into whichever frame happens to sit there (a dataclass's
generated ``__init__`` reads ``<string>:137``).  ``warn`` therefore
- shows a warning on global rank 0 only, unless it is a fact of one rank (``every_rank=True``:
  each rank shows it, prefixed with its rank);
- attributes it to the first frame outside this package and the libraries it extends
  (transformers, TRL, accelerate, datasets, torch, peft) and outside generated code, so it points
  at the user's line; Python's warning registry then shows one text from one line once;
- goes through ``warnings.warn``, so filters, ``-W`` and ``pytest.warns`` work as usual.
``info`` logs a line on rank 0 through the ``infinipipe_hf`` logger (INFO by default, with its own
handler on stderr, as transformers does for its logger; set its level to silence it).
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

_LIBRARIES = ("infinipipe_hf", "transformers", "trl", "accelerate", "datasets", "torch", "peft")
_logger = logging.getLogger("infinipipe_hf")


def global_rank() -> int:
    """This process's rank in the job (0 without a launcher)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0"))


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None) if mod is not None else None
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller of this function's caller) of
    the first frame that is neither library nor generated code."""
    dirs = _library_dirs()
    frame = sys._getframe(2)
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<") or os.path.abspath(name).startswith(dirs)):
            return level
        frame, level = frame.f_back, level + 1
    return max(2, level - 1)


def warn(message: str, category: type[Warning] = UserWarning, *, every_rank: bool = False) -> None:
    """Show ``message`` once, on rank 0 (or on every rank, with its rank, when it is a fact of
    that rank), attributed to the user's code."""
    rank = global_rank()
    if every_rank:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        message = f"rank {rank}: {message}" if world > 1 else message
    elif rank != 0:
        return
    warnings.warn(message, category, stacklevel=user_stacklevel())


def info(message: str) -> None:
    """Log ``message`` on rank 0 (logger ``infinipipe_hf``, level INFO)."""
    if global_rank() != 0:
        return
    if not _logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[infinipipe_hf] %(message)s"))
        _logger.addHandler(handler)
        if _logger.level == logging.NOTSET:
            _logger.setLevel(logging.INFO)
        _logger.propagate = False
    _logger.info(message)
