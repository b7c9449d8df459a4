"""Root of the test tree, which mirrors the package: ``tests/ir``, ``tests/planner/<sub-package>``,
``tests/runtime/<sub-package>`` (model-vs-runtime checks in ``tests/runtime`` itself), ``tests/trainer``,
``tests/profiling``, ``tests/data``, ``tests/models``, ``tests/cli``; ``tests/scripts`` tests scripts
and test helpers; ``tests/distributed`` launches gloo ranks; ``tests/gpu`` needs CUDA; shared
helpers live in ``tests/helpers``.

Every folder is a package, so tests import as ``tests.<folder>.<module>`` and helpers as
``tests.helpers.<module>``; the repository root is on ``sys.path`` through ``pythonpath = .`` in
pytest.ini.  Nothing here imports torch: the planner's tests (``tests/ir``, ``tests/planner``,
``tests/cli``, ``tests/data``) run without it.
"""
import pytest

# The helpers' own asserts (``local_pipeline.check`` and the references) report their operands on
# failure, as asserts in test modules do.
pytest.register_assert_rewrite("tests.helpers")
