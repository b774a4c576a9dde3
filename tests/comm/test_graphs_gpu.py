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
    AG_PER_SPLIT,
    DIFF_COUNTS,
    RS_PER_SPLIT,
    SPLITS,
    TWO_PHASE_COUNTS,
    diff_replay_matches_eager,
    gather_replay_matches_eager,
    replay_matches_eager,
    two_level_counts,
    two_level_replay_matches_eager,
    two_phase_replay_matches_eager,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (captured, replayed, ...) of each collective's captures: test_graphs.py's counts, which the
# CPU tier asserts of CodecGraphs(capture=False) on the same calls
CASES = {
    "reduce_scatter": (replay_matches_eager, tuple(len(SPLITS) * c for c in RS_PER_SPLIT)),
    "all_gather": (gather_replay_matches_eager, tuple(len(SPLITS) * c for c in AG_PER_SPLIT)),
    "all_gather_diff": (diff_replay_matches_eager, DIFF_COUNTS),
    "two_phase_all_reduce": (two_phase_replay_matches_eager, TWO_PHASE_COUNTS),
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
    on four GPUs, else gloo processes sharing the GPUs; the captures test_graphs.py counts."""
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
    assert got == [(*two_level_counts(cases), 6, 3)] * 4, got
