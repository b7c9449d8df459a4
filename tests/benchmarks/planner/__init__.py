"""Tests of ``benchmarks/planner`` scripts."""
