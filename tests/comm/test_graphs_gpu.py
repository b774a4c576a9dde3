"""GPU tier of ``reduce_scatter``, ``all_gather``, ``all_gather_diff``,
``two_phase_all_reduce`` and ``hierarchical_reduce_scatter`` with ``graphs=...``: the captured
and replayed segments give the eager call's bits at every step ([Note: codec segments
replayed]). One GPU: gloo processes share it (gloo moves CUDA tensors through the host); two or
more: NCCL, a rank per GPU."""

from __future__ import annotations

import pytest
import torch

from qsdp.testing import run_distributed

from .test_graphs import (
    SPLITS,
    diff_replay_matches_eager,
    gather_replay_matches_eager,
    replay_matches_eager,
    two_level_replay_matches_eager,
    two_phase_replay_matches_eager,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# per split, (captured, replayed) after the 3 calls of test_graphs.CALLS x 2 segments: the
# reduce-scatter's encode captured per bucket and its decode once per shape (3 first runs of
# 6); the all-gather's two shapes (a float32 output, bucket 1, and an in-place bf16 one,
# bucket 2) an encode and a decode each (4 first runs of 6). The weight-difference gathers: two
# sites (reconstructions) of one shape, each 3 difference calls of 5 (two exact): an encode
# and a decode captured at the first, replayed at the others
CASES = {
    "reduce_scatter": (replay_matches_eager, (3 * len(SPLITS), 3 * len(SPLITS))),
    "all_gather": (gather_replay_matches_eager, (4 * len(SPLITS), 2 * len(SPLITS))),
    "all_gather_diff": (diff_replay_matches_eager, (4, 8, 2, 1)),
    # CGX's two phases: 5 cases x 2 buckets; phase 1's sites (8: the second-group case shares
    # the several-runs case's) an encode each, each pair of sites (10) phase 1's decode and
    # phase 2's encode in one segment, phase 2's decode per shape (5): 23 captured of 5 x 3
    # calls x 3 segment runs, 22 replayed; sites: 10 composite, 8 of phase 1, 10 of phase 2
    "two_phase_all_reduce": (two_phase_replay_matches_eager, (23, 22, 28)),
}


@pytest.mark.parametrize("collective", list(CASES))
def test_captured_segments_replay_the_eager_bits(collective):
    worker, expected = CASES[collective]
    many = torch.cuda.device_count() >= 2
    ws = min(torch.cuda.device_count(), 4) if many else 3
    got = run_distributed(
        worker, ws, device="cuda", capture=True, backend="nccl" if many else "gloo", timeout_s=600
    )
    assert got == [expected] * ws, got


def test_two_level_segments_replay_the_eager_bits():
    """Over 2 nodes x 2 (row-major, and listed in another order) and 1 x 4: four ranks, NCCL
    on four GPUs, else gloo processes sharing the GPUs. Per two-level case (3 calls, 2 buckets,
    3 segments a call) an encode and a middle hop captured per bucket and a decode per shape:
    5 of 9 runs; the one-level case the single-level's 3 of 6."""
    cases = [([[0, 1], [2, 3]], "whole"), ([[3, 1], [2, 0]], "several runs")]
    cases.append(([[0, 1, 2, 3]], "one run each"))
    nccl = torch.cuda.device_count() >= 4
    got = run_distributed(
        two_level_replay_matches_eager,
        4,
        cases,
        device="cuda",
        capture=True,
        backend="nccl" if nccl else "gloo",
        timeout_s=600,
    )
    assert got == [(13, 11, 6, 3)] * 4, got
