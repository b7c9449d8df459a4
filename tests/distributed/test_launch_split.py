"""``launch.split_suites``: each test of a merged launch sees its own suite's part, passes only
when every rank ended its suite, and fails, naming why, when its suite failed or never ran."""
from __future__ import annotations

from tests.distributed.launch import LaunchResult, check_cases, split_suites


def _ranks(line: str, nproc: int = 2) -> str:
    return "".join(f"[rank {r}] {line}\n" for r in range(nproc))


def _suite(name: str, cases: list[str], end: bool = True) -> str:
    text = _ranks(f"SUITE {name} START") + "".join(_ranks(f"CASE {c} OK") for c in cases) + _ranks("ALL OK")
    return text + (_ranks(f"SUITE {name} END") if end else "Traceback: boom in " + name + "\n")


def test_every_suite_ended_every_part_passes_alone():
    out = "start-up noise\n" + _suite("a", ["a1", "a2"]) + _suite("b", ["b1"])
    parts = split_suites(LaunchResult(0, out, 3.0, False), ["a", "b"], 2)
    check_cases(parts["a"], 2, ["a1", "a2"])
    check_cases(parts["b"], 2, ["b1"])
    assert "b1" not in parts["a"].output and "a1" not in parts["b"].output


def test_a_failing_suite_fails_its_test_and_those_after_it_only():
    out = _suite("a", ["a1"]) + _suite("b", ["b1"], end=False)
    parts = split_suites(LaunchResult(1, out, 3.0, False), ["a", "b", "c"], 2)
    assert parts["a"].returncode == 0
    assert parts["b"].returncode == 1 and "boom in b" in parts["b"].output
    assert parts["c"].returncode == 1 and "suite c did not start" in parts["c"].output
    assert "boom in b" in parts["c"].output  # the launch's end, with the failure


def test_a_suite_ended_on_one_rank_only_or_a_failed_teardown_fails():
    half = _suite("a", ["a1"]).replace("[rank 1] SUITE a END\n", "")
    assert split_suites(LaunchResult(1, half, 3.0, False), ["a"], 2)["a"].returncode == 1
    torn = _suite("a", ["a1"]) + "terminate called without an active exception\n"
    assert split_suites(LaunchResult(-6, torn, 3.0, False), ["a"], 2)["a"].returncode == -6


def test_a_timed_out_launch_times_out_the_suites_that_did_not_end():
    out = _suite("a", ["a1"]) + _suite("b", ["b1"], end=False)
    parts = split_suites(LaunchResult(-9, out, 800.0, True), ["a", "b"], 2)
    assert parts["a"].returncode == 0 and not parts["a"].timed_out
    assert parts["b"].timed_out and parts["b"].returncode == -9
