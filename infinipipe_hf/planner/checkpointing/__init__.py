"""Which layers each (stage, unit) recomputes: memory walk and solvers."""
