"""Every test under tests/gpu needs CUDA: mark it ``gpu`` (so ``-m "not gpu"`` deselects it) and
skip it without a CUDA device, even in a file that forgot its own ``pytestmark``."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    import torch

    cuda = torch.cuda.is_available()
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
