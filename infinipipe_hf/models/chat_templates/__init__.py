"""Chat templates shipped with the package (package data)."""
