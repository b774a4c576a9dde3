"""Test-session setup: Triton runs in its interpreter on CPU machines (set before triton loads)."""

import os

import pytest
import torch

from qsdp.testing import preload

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # CI's 2 cores run 2 test workers (-n 2), each with torch's default of one intra-op thread
    # per core, beside the ranks and subprocesses the tests start: one thread per process (the
    # ranks of qsdp.testing.run_distributed have one already) keeps them from fighting
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# MKL's matrix products may round differently with the operands' memory alignment (a tensor
# loaded from a checkpoint sits elsewhere than the one it was saved from): on an AVX-512 CPU a
# resumed run ended 5e-7 off its uninterrupted twin (test_ddp_and_hsdp_train_count_and_resume,
# every run, on 2026-11-28's development machine). MKL's conditional numerical reproducibility
# makes them depend on the values alone; the ranks the tests start inherit it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# What the ranks of run_distributed import besides torch and qsdp, once in the server they fork
# from rather than in each rank: every test module imports pytest, the trainer's tests the
# trainer and torch.distributed.checkpoint ([Note: why forkserver] in qsdp.testing.distributed)
preload("pytest", "numpy", "torch.distributed.checkpoint", "qsdp_train.trainer", "tests.models",
        "tests.tiny_gpt")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
