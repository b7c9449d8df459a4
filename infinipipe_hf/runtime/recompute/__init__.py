"""Per-layer activation checkpointing and its finer levels."""
