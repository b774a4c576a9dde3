"""Every rank must install the same compression: a rank with other arguments makes every rank
raise at installation, for FSDP2 (compress_fsdp) and DDP (register), instead of decoding garbage
or hanging in the first step."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.testing import run_distributed

from ..models import classifier


def _install(rank: int, world: int, case: str) -> str:
    init_device_mesh("cpu", (world,))
    odd = rank == world - 1  # the last rank disagrees
    try:
        if case.startswith("fsdp"):
            model = classifier()
            fully_shard(model[2])
            fully_shard(model)
            config = {
                "fsdp-recipe": "sdp4bit" if odd else "qsdp-w8g8",
                "fsdp-seed": qsdp.recipe("qsdp-w8g8", seed=1 if odd else 0),
                "fsdp-same": qsdp.recipe("qsdp-w8g8", seed=7),
            }[case]
            qsdp.compress_fsdp(model, config)
        else:
            ddp = DDP(classifier())
            qsdp.ddp.register(ddp, "cgx", error_feedback=odd if case == "ddp-feedback" else False)
    except ValueError as e:
        return str(e)
    return "installed"


@pytest.mark.parametrize("case", ["fsdp-recipe", "fsdp-seed", "ddp-feedback"])
def test_a_rank_with_other_arguments_fails_on_every_rank(case):
    out = run_distributed(_install, 3, case, timeout_s=120)
    for message in out:  # every rank, the same verdict, naming the odd rank and the fix
        assert "passed other arguments than rank 0" in message and "ranks [2]" in message, message
        assert "pass the same recipe, overrides and seed on every rank" in message
    if case == "fsdp-seed":  # each rank names what it passed
        assert "seed=1" in out[2] and "seed=0" in out[0]


def test_the_same_arguments_install():
    assert run_distributed(_install, 3, "fsdp-same") == ["installed"] * 3
    assert run_distributed(_install, 2, "ddp-same") == ["installed"] * 2
