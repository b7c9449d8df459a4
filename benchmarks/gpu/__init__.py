"""The GPU checks (``gpu_suite.sh`` and the scripts it runs); every one has a CPU dry run."""
