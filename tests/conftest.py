"""Test-session setup: Triton runs in its interpreter on CPU machines (set before triton loads)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # CI's 2 cores run 2 test workers (-n 2), each with torch's default of one intra-op thread
    # per core, beside the ranks and subprocesses the tests start: one thread per process (the
    # ranks of qsdp.testing.run_distributed have one already) keeps them from fighting
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
