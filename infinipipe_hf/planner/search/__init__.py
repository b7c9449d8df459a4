"""Plan a step: try a schedule's candidates, keep the fastest that fits; validate; limits; static settings."""
