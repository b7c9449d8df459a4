"""Units become action lists: the Schedule interface, the pipeline schedules, warm-ups, grouping, grids."""
