"""1F1B machinery every pipeline schedule shares: action lists and warm-ups, pipeline grouping, the closed-form estimate, knob grids."""
