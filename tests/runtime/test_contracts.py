"""The runtime's contracts with the integrations (qsdp.runtime.contracts): both integrations'
staleness states satisfy one protocol, and a wrong argument fails at once, naming what it lacks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.runtime import (
    FlaggedReduction,
    LocalGradients,
    StalenessState,
    WeightPrediction,
    check_contract,
)
from qsdp.testing import run_distributed

from ..models import classifier


def _states(rank: int, world: int) -> dict:
    fsdp_model = classifier()
    fully_shard(fsdp_model)
    qsdp.compress_fsdp(
        fsdp_model, "cgx", schedule=qsdp.Schedule(staleness=1, start=0, predict="none")
    )
    fsdp_state = qsdp.fsdp.comm_state(fsdp_model)
    ddp_state = qsdp.ddp.register(
        DDP(classifier()), "cgx", schedule=qsdp.Schedule(staleness=1, start=0, predict="none")
    )
    hooks = qsdp.fsdp._state._installed(fsdp_model).hooks
    return {
        "fsdp": isinstance(fsdp_state, StalenessState),
        "ddp": isinstance(ddp_state, StalenessState),
        "fsdp_hooks_report": all(isinstance(h, FlaggedReduction) for h in hooks),
    }


def test_both_integrations_offer_one_staleness_state():
    for r in run_distributed(_states, 2):
        assert r == {"fsdp": True, "ddp": True, "fsdp_hooks_report": True}


def test_a_wrong_local_fails_at_once_naming_what_it_lacks():
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="needs a LocalGradients.*lacks.*keep_local_gradients"):
        WeightPrediction(opt, local=object())
    with pytest.raises(TypeError, match="lacks.*local_gradients"):
        check_contract(type("Half", (), {"keep_local_gradients": 0})(), LocalGradients, what="x")
