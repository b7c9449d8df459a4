"""Which pp x sp x dp x shard to run: every layout of a job planned, the fastest that fits recommended."""
