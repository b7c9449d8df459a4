"""Tables of the planner benchmark, one module each, run by ``benchmarks/planner/planner_bench.py``.

A table module has ``NAME`` (the ``--only`` key and the JSON file name
``benchmarks/results/planner_<NAME>.json``), ``DESCRIPTION``, ``run(quick, profile) -> dict`` (the
JSON report: rows and whatever the table needs) and ``markdown(report) -> str`` (the README-ready
table).  Add a table by writing a module and listing it in ``TABLES``.  ``setups.py`` holds the
benchmark's setups and batches, shared by ``planner_bench.py``, the tables, ``solver_study.py`` and ``planning_time.py``.
``calibrated.py`` re-plans two tables under the calibrated profile (a script, not a table).
"""
from . import (
               checkpoint_levels,
               flexsp_solver,
               paper_layout,
               paper_table,
               sharded_70b,
               sp_limits,
               static_vs_tuned,
               users_alternatives,
)

TABLES = {m.NAME: m for m in (paper_layout, sp_limits, sharded_70b, checkpoint_levels, users_alternatives,
                              static_vs_tuned, flexsp_solver, paper_table)}
