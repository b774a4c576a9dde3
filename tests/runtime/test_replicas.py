"""qsdp.runtime.check_replicas / replica_mismatches ([Note: checking replicas]); the trainer's
check before a checkpoint is tested in tests/train/test_checkpoint.py."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from qsdp.runtime import check_replicas, replica_mismatches
from qsdp.testing import run_distributed

from ..models import classifier


def _hsdp_like(rank: int, world: int, corrupt: bool) -> dict:
    # a (replicate, shard) mesh of 2 x 2: ranks 0/2 and 1/3 replicate each other
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(10 + mesh["shard"].get_local_rank())  # the shard's own values
    model = classifier()
    if corrupt and rank == 3:  # one replica of shard 1: one value of one weight
        with torch.no_grad():
            model[2].weight[0, 0] += 1.0
    out = {"mismatches": replica_mismatches(model, mesh["replicate"].get_group())}
    try:
        check_replicas(model, mesh["replicate"].get_group(), where="in the test")
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_agreeing_replicas_pass():
    for out in run_distributed(_hsdp_like, 4, False):
        assert out == {"mismatches": [], "error": None}, out


def test_one_differing_replica_fails_every_rank_of_the_world():
    out = run_distributed(_hsdp_like, 4, True)
    for rank, o in enumerate(out):
        assert o["error"] is not None and "replicas of the model differ in the test" in o["error"]
        if rank in (1, 3):  # shard 1's replicas name the weight and the rank
            assert o["mismatches"] == ["2.weight (ranks [3] differ from rank 1)"], o
            assert "2.weight (ranks [3] differ from rank 1)" in o["error"]
        else:  # shard 0's replicas agree, and raise with the world
            assert o["mismatches"] == [] and "none here" in o["error"], o
