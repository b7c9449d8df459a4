"""A batch becomes units: elastic slices and packs, uniform baselines, packing, DP assignment, rounds."""
