"""Native libraries writing to file descriptor 1 while the CLI plans (HiGHS prints diagnostics
there with its display off) do not reach standard output: ``--json`` stays parseable."""
import json
import os

import pytest

from infinipipe_hf.cli import plan as plan_cli
from infinipipe_hf.cli import plan_layouts
from infinipipe_hf.cli.native_output import native_output_to_stderr
from tests.cli.test_plan_host_cli import LENGTHS, _files

NOISE = b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n"


def noisy(fn):
    def wrapped(*a, **k):
        os.write(1, NOISE)  # what a native library does, below Python's sys.stdout
        return fn(*a, **k)
    return wrapped


@pytest.mark.parametrize("search", [False, True])
def test_json_output_parses_when_native_code_writes_to_descriptor_1(tmp_path, capfd, monkeypatch, search):
    if search:
        monkeypatch.setattr(plan_layouts, "run_search", noisy(plan_layouts.run_search))
        extra = ["--world-size", "2", "--gpus-per-node", "2", "--memory-budget-gib", "1", "--search-layout"]
    else:
        monkeypatch.setattr(plan_cli, "run", noisy(plan_cli.run))
        extra = ["--pp", "2", "--memory-budget-gib", "1"]
    assert plan_cli.main([*_files(tmp_path, LENGTHS), *extra, "--json"]) == 0
    out, err = capfd.readouterr()
    assert isinstance(json.loads(out), dict)
    assert NOISE.decode() in err  # not lost: it went to standard error


def test_descriptor_1_is_restored_after_planning(capfd):
    with native_output_to_stderr():
        os.write(1, b"during\n")
    os.write(1, b"after\n")
    out, err = capfd.readouterr()
    assert out == "after\n" and err == "during\n"
