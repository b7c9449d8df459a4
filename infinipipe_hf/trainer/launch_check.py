"""Recognising a launch that started fewer processes than the user asked for.

``accelerate launch --cpu --num_processes 2 train.py`` (and a ``MULTI_CPU`` config without MPI)
starts ONE process: accelerate's "simple" launcher runs the script once, with
``ACCELERATE_USE_CPU`` set and none of the ``WORLD_SIZE``/``RANK`` variables a multi-process
launcher sets.  The pipeline then sees a world of one and the user a confusing "pp_degree does not
divide 1".  ``single_process_accelerate_launch`` recognises that case from the environment and,
on Linux, reads the requested count from the launcher's command line (the parent process), so the
error can say what happened and name a command that works.

Trade-off: the parent's command line is only readable on Linux (``/proc``); elsewhere, or when
the count came from an accelerate config file, the message says the same without the count.
"""
from __future__ import annotations

import os
import re
from typing import Callable


def parent_command_line() -> list[str]:
    """The parent process's argv (Linux ``/proc``); empty where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def requested_processes(argv: list[str]) -> int | None:
    """``--num_processes N`` (or ``--num-processes=N``) on an ``accelerate launch`` command line."""
    text = " ".join(argv)
    if "accelerate" not in text:
        return None
    m = re.search(r"--num[_-]processes(?:=|\s+)(\d+)", text)
    return int(m.group(1)) if m else None


def single_process_accelerate_launch(env: dict[str, str] | None = None,
                                     read_parent: Callable[[], list[str]] = parent_command_line
                                     ) -> tuple[bool, int | None]:
    """``(True, requested count or None)`` when accelerate's single-process launcher started us."""
    env = os.environ if env is None else env
    if "ACCELERATE_USE_CPU" not in env or "WORLD_SIZE" in env or "RANK" in env:
        return False, None
    return True, requested_processes(read_parent())


def launch_hint(requested: int | None, stage_ranks: int) -> str:
    n = requested if requested is not None else max(stage_ranks, 2)
    return (f"`accelerate launch --cpu` (and a MULTI_CPU config) starts ONE process"
            f"{f', although --num_processes {requested} was asked for' if requested else ''}; "
            f"launch with `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {n} "
            f"SCRIPT ...` or `torchrun --nproc_per_node {n} SCRIPT ...` (recipes/accelerate/"
            f"cpu_4proc.yaml is a working accelerate config)")


def check_single_process_launch(stage_ranks: int, world_size: int, *, env: dict[str, str] | None = None,
                                read_parent: Callable[[], list[str]] = parent_command_line) -> str | None:
    """Raise when accelerate started one process for a run whose replica needs ``stage_ranks``
    (``pp_degree x sp_degree``) more; return a warning text when it started one although more
    were asked for (a one-rank replica still runs)."""
    if world_size != 1:
        return None
    single, requested = single_process_accelerate_launch(env, read_parent)
    if not single:
        return None
    if stage_ranks > 1:
        raise ValueError(f"pp_degree x sp_degree = {stage_ranks} needs a multiple of {stage_ranks} processes but "
                         f"this run has 1: {launch_hint(requested, stage_ranks)}")
    if requested is not None and requested > 1:
        return f"this run has 1 process (no data parallelism): {launch_hint(requested, stage_ranks)}"
    return None
