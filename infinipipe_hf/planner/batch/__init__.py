"""A batch becomes units: elastic slices and packs, uniform baselines, DP assignment."""
