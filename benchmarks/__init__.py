"""Benchmarks of infinipipe_hf (not shipped with the package): run each script as a module from the
repository root, e.g. ``python -m benchmarks.planner.planner_bench --quick``; see README.md."""
