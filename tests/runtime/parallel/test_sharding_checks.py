"""Sharding checks that need no process group: which worlds have a group for each ``shard`` mode,
a torch without FSDP2, and copying a full tensor into a (plain) parameter.  The sharded runtime
itself is tested on 4 processes in ``tests/distributed/test_sharded_stages.py``."""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf import InfiniPipeConfig, PipelineEngine  # noqa: E402
from infinipipe_hf.layout import ParallelDims, shard_mode  # noqa: E402
from infinipipe_hf.layout.checks import check_shard_group  # noqa: E402
from infinipipe_hf.runtime.parallel.fsdp_api import copy_full_, fsdp2_api  # noqa: E402
from tests.helpers.reference import tiny_model  # noqa: E402


@pytest.mark.parametrize("shard, dp, sp", [("none", 1, 1), ("dp", 2, 1), ("dp", 2, 4), ("sp", 1, 2),
                                           ("sp", 3, 2), ("sp+dp", 2, 2), ("hybrid", 2, 4)])
def test_worlds_with_a_group_pass(shard, dp, sp):
    check_shard_group(ParallelDims(1, sp, dp), shard_mode(shard))


@pytest.mark.parametrize("shard, dp, sp, fragments", [
    ("dp", 1, 1, ["shard='dp'", "dp_degree=1", "no DP group", "use shard='none'"]),
    ("dp", 1, 2, ["no DP group", "use shard='sp' or 'none'"]),
    ("sp", 2, 1, ["shard='sp'", "sp_degree=1", "no SP group", "use shard='dp' or 'none'"]),
    ("sp+dp", 1, 2, ["shard='sp+dp'", "dp_degree >= 2 and sp_degree >= 2", "dp_degree=1",
                     "use shard='sp'"]),
    ("hybrid", 2, 1, ["shard='hybrid'", "replicates over DP", "sp_degree=1", "use shard='dp'"]),
    ("hybrid", 1, 2, ["shard='hybrid'", "dp_degree=1", "use shard='sp'"]),
    ("zero3", 2, 2, ["shard='zero3' is not known"]),
])
def test_worlds_without_the_group_say_what_to_do(shard, dp, sp, fragments):
    with pytest.raises(ValueError) as info:
        check_shard_group(ParallelDims(1, sp, dp), shard_mode(shard))
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_engine_refuses_sharding_in_a_world_of_one():
    with pytest.raises(ValueError, match="shard='dp'.*no DP group"):
        PipelineEngine(tiny_model("llama", num_layers=2), InfiniPipeConfig(shard="dp"))


def test_torch_without_fsdp2_is_a_clear_error(monkeypatch):
    # ``None`` in sys.modules makes ``import torch.distributed.fsdp`` raise ImportError, as on a
    # torch built without it.
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)
    with pytest.raises(ValueError, match=r"shard='sp' needs torch's FSDP2 .*use shard='none'"):
        fsdp2_api("shard='sp'")
    # The engine checks it first, before the world (a world of one has no DP group either).
    with pytest.raises(ValueError, match=r"shard='dp' needs torch's FSDP2"):
        PipelineEngine(tiny_model("llama", num_layers=2), InfiniPipeConfig(shard="dp"))


def test_fsdp2_without_what_we_drive_is_a_clear_error(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    with pytest.raises(ValueError, match=r"FSDP2 without set_reduce_scatter_unused_params; upgrade"):
        fsdp2_api("shard='dp'")


def test_fsdp2_present_in_this_torch():
    fully_shard, policy, module_type = fsdp2_api("shard='dp'")
    assert callable(fully_shard) and policy().param_dtype is None and isinstance(module_type, type)


def test_copy_full_into_a_plain_parameter_and_shape_check():
    dst = torch.zeros(3, 2)
    full = torch.arange(6.0).reshape(3, 2)
    copy_full_(dst, full)
    assert torch.equal(dst, full)
    with pytest.raises(ValueError, match=r"shape \(2, 3\) does not match the parameter's \(3, 2\)"):
        copy_full_(dst, full.reshape(2, 3))
