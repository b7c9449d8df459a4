"""Try candidate settings, keep the fastest feasible plan."""
