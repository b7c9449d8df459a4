"""Keep native libraries' prints off the planner CLI's standard output.

HiGHS (the LP/MILP solver behind ``scipy.optimize.milp`` and ``linprog``) can print a diagnostic
line straight to file descriptor 1 even with its display off, which would break ``--json``
output for anything reading it.  While the CLI plans, descriptor 1 points at standard error;
Python's own ``print`` calls are unaffected (they go through ``sys.stdout``).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def native_output_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at standard error for the duration (no-op where it cannot)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptors to juggle (an embedded interpreter): leave them alone
        yield
        return
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
