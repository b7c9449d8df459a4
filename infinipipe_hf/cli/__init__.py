"""Command-line entry points: plan, profile, demo, and the plan's charts."""
