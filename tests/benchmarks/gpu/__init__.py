"""Tests of ``benchmarks/gpu`` scripts (their CPU dry runs)."""
