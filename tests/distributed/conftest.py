"""Fixtures of the distributed tests.

``suite_run``: the test's part of a merged launch (``launch.merged_launch``).  A test names its
suite with ``@pytest.mark.merged_launch("<suite>")``; the first such test of a world size starts
one launch for the suites of every selected test of that size (``-k`` picks fewer), and each test
then checks its own part as it would check a launch of its own.

``trainer_refs``: the plain HF ``Trainer`` references of ``workers/trainer_common.SCENARIOS`` at
dp 1 and 2, written once per session (xdist workers included) into one folder as the tests first
ask for them.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tests.distributed.launch import SUITES, LaunchResult, merged_launch


class TrainerRefs:
    """One folder of ``reference_run`` results (dp 1 and 2), each scenario run once: once per
    session, also across pytest-xdist workers (they share the folder, a lock per scenario)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def dir(self, names) -> str:
        """The folder, holding the references of the scenarios ``names`` (computed if missing)."""
        from filelock import FileLock

        from tests.distributed.workers.trainer_common import SCENARIOS, reference_run  # torch: only here

        for name in names:
            done = self.folder / f"{name}.done"
            with FileLock(str(self.folder / f"{name}.lock")):
                if not done.exists():
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        reference_run(SCENARIOS[name], str(self.folder), dp_degrees=(1, 2))
                    done.touch()
        return str(self.folder)

    @staticmethod
    def all_scenarios() -> list[str]:
        from tests.distributed.workers.trainer_common import SCENARIOS

        return list(SCENARIOS)


@pytest.fixture(scope="session")
def trainer_refs(tmp_path_factory) -> TrainerRefs:
    base = tmp_path_factory.getbasetemp()
    # pytest-xdist workers' base folders sit side by side in the session's own: share that one.
    return TrainerRefs((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "trainer_refs")


class MergedLaunches:
    """One merged launch per world size, started when a test first needs it."""

    def __init__(self, selected: set[str], refs: TrainerRefs, tmp: pytest.TempPathFactory) -> None:
        self.selected, self.refs, self.tmp = selected, refs, tmp
        self.parts: dict[str, LaunchResult] = {}

    def result(self, name: str) -> LaunchResult:
        if name not in SUITES:
            raise ValueError(f"merged_launch names suite {name!r}; known: {sorted(SUITES)}")
        if name not in self.parts:
            nproc = SUITES[name][0]
            names = [n for n in SUITES if SUITES[n][0] == nproc and (n in self.selected or n == name)]
            self.parts.update(merged_launch({n: self._args(n) for n in names}))
        return self.parts[name]

    def _args(self, name: str) -> list[str]:
        args = SUITES[name][2]
        refs = self.refs.dir(self.refs.all_scenarios()) if "{refs}" in args else ""
        out = str(self.tmp.mktemp(name)) if "{out}" in args else ""
        return [a.replace("{refs}", refs).replace("{out}", out) for a in args]


@pytest.fixture(scope="session")
def merged_launches(request, trainer_refs, tmp_path_factory) -> MergedLaunches:
    selected = {m.args[0] for item in request.session.items for m in item.iter_markers("merged_launch")}
    return MergedLaunches(selected, trainer_refs, tmp_path_factory)


@pytest.fixture
def suite_run(request, merged_launches) -> LaunchResult:
    marker = request.node.get_closest_marker("merged_launch")
    if marker is None:
        raise ValueError(f"{request.node.nodeid} uses suite_run without @pytest.mark.merged_launch(\"<suite>\")")
    return merged_launches.result(marker.args[0])

