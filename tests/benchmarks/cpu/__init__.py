"""Tests of ``benchmarks/cpu`` scripts."""
