"""Tests of ``benchmarks/lib``: runtime rows, their clock and the profile fit."""
