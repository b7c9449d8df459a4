"""A launch that started one process where more were asked for is recognised and explained."""
from __future__ import annotations

import pytest

from infinipipe_hf.trainer.launch_check import check_single_process_launch, requested_processes

ACCEL_ENV = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ACCEL_ARGV = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "train.py"]


def test_single_process_accelerate_with_pp2_names_the_working_commands():
    with pytest.raises(ValueError) as info:
        check_single_process_launch(2, 1, env=ACCEL_ENV, read_parent=lambda: ACCEL_ARGV)
    msg = str(info.value)
    assert "pp_degree x sp_degree = 2 needs a multiple of 2 processes but this run has 1" in msg
    assert "although --num_processes 2 was asked for" in msg
    assert "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2" in msg
    assert "torchrun --nproc_per_node 2" in msg


def test_pp1_runs_but_says_that_data_parallelism_was_lost():
    note = check_single_process_launch(1, 1, env=ACCEL_ENV, read_parent=lambda: ACCEL_ARGV)
    assert note and "this run has 1 process" in note and "--num_processes 2" in note
    assert check_single_process_launch(1, 1, env=ACCEL_ENV, read_parent=lambda: []) is None


def test_other_launches_are_left_alone():
    torchrun = {"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_USE_CPU": "True"}
    assert check_single_process_launch(2, 2, env=torchrun, read_parent=lambda: ACCEL_ARGV) is None
    assert check_single_process_launch(2, 1, env={}, read_parent=lambda: ACCEL_ARGV) is None  # plain python
    with pytest.raises(ValueError, match="accelerate launch --multi_gpu --num_processes 4"):
        # count unknown (from a config file): the message still says what to run
        check_single_process_launch(4, 1, env=ACCEL_ENV, read_parent=lambda: ["accelerate", "launch", "x.py"])


@pytest.mark.parametrize("argv, n", [(ACCEL_ARGV, 2), (["accelerate", "launch", "--num-processes=8", "x"], 8),
                                     (["torchrun", "--nproc_per_node", "2", "x"], None),
                                     (["accelerate", "launch", "x.py"], None)])
def test_requested_processes(argv, n):
    assert requested_processes(argv) == n
