"""GPU tier of reduce_scatter(graphs=...): the captured and replayed segments give the eager
call's bits at every step ([Note: codec segments replayed]). One GPU: three gloo processes
share it (gloo moves CUDA tensors through the host); two or more: NCCL, a rank per GPU."""

from __future__ import annotations

import pytest
import torch

from qsdp.testing import run_distributed

from .test_graphs import SPLITS, gather_replay_matches_eager, replay_matches_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_captured_segments_replay_the_eager_bits():
    many = torch.cuda.device_count() >= 2
    ws = min(torch.cuda.device_count(), 4) if many else 3
    got = run_distributed(
        replay_matches_eager,
        ws,
        device="cuda",
        capture=True,
        backend="nccl" if many else "gloo",
        timeout_s=600,
    )
    # per split: the encode captured per bucket (2), the decode once per shape; every later
    # run replayed: 2 steps x 2 buckets x 2 segments, less the 3 first runs
    assert all(g == (3 * len(SPLITS), 5 * len(SPLITS)) for g in got), got


def test_captured_gathers_replay_the_eager_bits():
    many = torch.cuda.device_count() >= 2
    ws = min(torch.cuda.device_count(), 4) if many else 3
    got = run_distributed(
        gather_replay_matches_eager,
        ws,
        device="cuda",
        capture=True,
        backend="nccl" if many else "gloo",
        timeout_s=600,
    )
    # per split: two shapes (a float32 and an in-place bf16 output), an encode and a decode
    # captured for each; 2 steps x 2 buckets x 2 segments, less the 4 first runs, replayed
    assert all(g == (4 * len(SPLITS), 4 * len(SPLITS)) for g in got), got
