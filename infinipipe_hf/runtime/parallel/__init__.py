"""Process groups, point-to-point transfers, sequence parallelism, FSDP2, gradient sync."""
