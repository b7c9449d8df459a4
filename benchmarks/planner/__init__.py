"""The planner's benchmarks (torch-free planning; tokens/s simulated with the cost model)."""
