"""TRL's ``activation_offloading`` maps onto the host tier: on by default, a warning when the host
budget turns the tier off, and the pipeline fields on ``EPPSFTConfig``."""
import warnings

import pytest

pytest.importorskip("trl")

from infinipipe_hf.trainer.sft.config import EPPSFTConfig  # noqa: E402
from infinipipe_hf.trainer.sft.trainer import _warn_ignored  # noqa: E402


def args(tmp_path, **kw):
    return EPPSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)


def test_activation_offloading_is_mapped_not_ignored(tmp_path, monkeypatch):
    from infinipipe_hf.trainer import notices

    a = args(tmp_path, activation_offloading=True, host_memory_gib=4.0)
    assert a.to_infinipipe_config().host_budget_bytes() == 4.0 * 2**30
    said = []
    monkeypatch.setattr(notices, "info", said.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignored" warning any more
        _warn_ignored(a)
    assert len(said) == 1 and "may offload layer inputs and K/V to host memory" in said[0]


def test_activation_offloading_with_no_host_budget_warns(tmp_path):
    with pytest.warns(UserWarning, match="host_memory_gib=0 turns the host tier off, so nothing is offloaded"):
        _warn_ignored(args(tmp_path, activation_offloading=True, host_memory_gib=0.0))


def test_state_offload_is_an_sft_argument(tmp_path):
    cfg = args(tmp_path, state_offload="optimizer", pp_degree=2).to_infinipipe_config()
    assert cfg.state_offload == "optimizer"


def test_activation_offloading_on_cpu_without_a_host_budget_warns(tmp_path):
    """A CPU device's memory is host memory: the tier is off unless host_memory_gib is given."""
    with pytest.warns(UserWarning, match="on a CPU device offloads nothing by default"):
        _warn_ignored(args(tmp_path, activation_offloading=True))
