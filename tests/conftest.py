"""Shared test setup. Time limits: a test waits on a subprocess at most ``tests.limits.hang_s()`` (a generous base
scaled by the machine's load) -- a hang-catcher, never a speed judgement; see tests/limits.py."""

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Without a GPU, Triton runs only in its interpreter, and TRITON_INTERPRET is read when triton is first imported:
# set it before any test module can import it (the kernel-switch tests reach forgetrain.kernels before
# test_kernels.py runs, and the interpreter then stayed off for the whole test run).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test run shares one data cache (prepared once), separate from the user's."""
    cache = os.environ.get("FORGETRAIN_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "ftcache")
    monkeypatch.setenv("FORGETRAIN_CACHE", cache)
    yield


@pytest.fixture
def golden_root(tmp_path, monkeypatch):
    """``forgetrain.verify.GOLDEN_ROOT`` pointed at an empty directory of the test's own: goldens made there."""
    from forgetrain import verify as V

    root = tmp_path / "goldens"
    monkeypatch.setattr(V, "GOLDEN_ROOT", root)
    return root


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
