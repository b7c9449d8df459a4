"""Tests of the benchmarks (``benchmarks/``), one folder per benchmarks folder."""
