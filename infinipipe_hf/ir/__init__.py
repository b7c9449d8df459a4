"""The planner -> runtime contract: units, actions, plans, checkpoint levels, model shapes (torch-free)."""
