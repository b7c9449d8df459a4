"""Data: offline real corpora (``corpus``) and seeded synthetic length distributions (``synthetic``)."""
