"""A plan replayed with the cost model: step time, bubbles, recompute, memory."""
