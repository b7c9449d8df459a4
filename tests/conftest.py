"""Root of the test tree, which mirrors the package: ``tests/ir``, ``tests/planner/<sub-package>``,
``tests/runtime/<sub-package>`` (model-vs-runtime checks in ``tests/runtime`` itself), ``tests/trainer``,
``tests/profiling``, ``tests/data``, ``tests/models``, ``tests/cli``; ``tests/scripts`` tests scripts
and test helpers; ``tests/distributed`` launches gloo ranks; ``tests/gpu`` needs CUDA; shared
helpers live in ``tests/helpers``.

Every folder is a package, so tests import as ``tests.<folder>.<module>`` and helpers as
``tests.helpers.<module>``; the repository root is on ``sys.path`` through ``pythonpath = .`` in
pytest.ini.  Nothing here imports torch: the planner's tests (``tests/ir``, ``tests/planner``,
``tests/cli``, ``tests/data``) run without it.

Under pytest-xdist (``scripts/test.sh`` runs ``-n 2``) each test file is a work unit, handed to
whichever worker is free (its module fixtures are built once), except that every test marked
``merged_launch`` forms one unit (they share one launch per world size, ``tests/distributed``).
Units go out longest first, as far as marks tell: the merged launches, then the files with tests
marked ``slow``, then those with tests marked ``distributed`` (launched ranks) and the notebooks
(a kernel each, two of them launch ranks), then the rest, each in collection order, so that no
long file starts last while the other worker runs dry.  Workers tell
the controller which tests are marked through a file named in their ``workerinput``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest

# The helpers' own asserts (``local_pipeline.check`` and the references) report their operands on
# failure, as asserts in test modules do.
pytest.register_assert_rewrite("tests.helpers")

MERGED_UNIT = "merged launches"
"""The work unit of the tests marked ``merged_launch``."""
_MARKS = ("merged_launch", "slow", "distributed")
_LANES_KEY = "infinipipe_lanes_dir"


def _lanes_dir(config: pytest.Config) -> Path:
    """The controller's folder where each worker writes the node ids of its marked tests."""
    if not hasattr(config, "_infinipipe_lanes_dir"):
        config._infinipipe_lanes_dir = Path(tempfile.mkdtemp(prefix="infinipipe-lanes-"))
    return config._infinipipe_lanes_dir


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Controller side: tell each worker where to write its marked node ids."""
    node.workerinput[_LANES_KEY] = str(_lanes_dir(node.config))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker side: write the node ids of the tests marked ``merged_launch``, ``slow`` or
    ``distributed`` (after every other hook has added its marks) before the collection goes to
    the controller."""
    folder = getattr(config, "workerinput", {}).get(_LANES_KEY)
    if folder:
        marked = {m: [item.nodeid for item in items if item.get_closest_marker(m)] for m in _MARKS}
        target = Path(folder) / f"{config.workerinput['workerid']}.json"
        target.with_suffix(".tmp").write_text(json.dumps(marked))
        os.replace(target.with_suffix(".tmp"), target)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_infinipipe_lanes_dir", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class _Marked:
    """The marked node ids the workers wrote, read once the collection is complete."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ids: dict[str, set[str]] | None = None

    def __call__(self, mark: str) -> set[str]:
        if self.ids is None:
            self.ids = {m: set() for m in _MARKS}
            for path in self.folder.glob("*.json"):
                for m, ids in json.loads(path.read_text()).items():
                    self.ids[m].update(ids)
        return self.ids[mark]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n N`` (``--dist load``, xdist's default): the work units above instead of single tests
    handed out one by one; any other ``--dist`` is xdist's own."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    marked = _Marked(_lanes_dir(config))

    class LongestFirst(OrderedDict):
        """The work queue: the next unit is the first of the longest kind (see the module doc)."""

        def popitem(self, last: bool = True):
            if last:
                return super().popitem(last=True)
            scope = min(self, key=self.kind)  # min keeps the first of equals: collection order
            return scope, self.pop(scope)

        def kind(self, scope: str) -> int:
            if scope == MERGED_UNIT:
                return 0
            for rank, mark in enumerate(("slow", "distributed"), start=1):
                if any(nodeid in marked(mark) for nodeid in self[scope]):
                    return rank
            return 2 if scope.endswith(".ipynb") else 3

    class UnitScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False
            self.workqueue = LongestFirst()

        def _split_scope(self, nodeid: str) -> str:
            return MERGED_UNIT if nodeid in marked("merged_launch") else nodeid.split("::", 1)[0]

    return UnitScheduling(config, log)
