"""qsdp.testing.assert_replicas_agree: the benchmarks' check that replicas hold the same bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qsdp.testing import assert_replicas_agree, run_distributed


def _check(rank: int, world: int, perturb: bool) -> str | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3).to(torch.bfloat16))
    if perturb and rank == 1:  # one bit of one value of one rank's second weight
        w = model[1].weight.data.view(torch.int16)
        w[0, 0] ^= 1
    try:
        assert_replicas_agree(model)
    except AssertionError as e:
        return str(e)
    return None


def test_identical_replicas_pass():
    assert run_distributed(_check, 3, False) == [None, None, None]


@pytest.mark.parametrize("world", [2, 3])
def test_one_flipped_bit_fails_on_every_rank_and_names_the_parameter(world):
    for err in run_distributed(_check, world, True):
        assert err is not None and "1 of 4 parameters" in err and "1.weight" in err, err
        assert "1.weight (ranks [1] differ from rank 0)" in err, err
