"""Units become action lists: pipeline schedules, warm-ups, grouping."""
