"""A plan replayed with the cost model: step time, bubbles, memory; validation."""
