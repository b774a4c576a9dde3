"""[Note: a call refused on one rank]: with QSDP_CHECK_CALLS=1 every rank of a collective raises
together when one rank's checks fail or the ranks were asked for different calls, instead of
leaving the others in the exchange; a good call after it still runs."""

from __future__ import annotations

import os

import torch

from qsdp.comm import (
    all_gather,
    integer_all_reduce,
    reduce_scatter,
    two_phase_all_reduce,
)
from qsdp.quant import QuantSpec
from qsdp.testing import assert_same_on_all_ranks, run_distributed

SPEC = QuantSpec(bits=4, group_size=64, scheme="minmax", rounding="stochastic")


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "ran"


def _checked(rank: int, world: int) -> dict[str, str]:
    os.environ["QSDP_CHECK_CALLS"] = "1"
    x = torch.randn(301, generator=torch.Generator().manual_seed(rank))
    out = {}
    # a good call runs, the same bits as unchecked
    t = x.clone()
    two_phase_all_reduce(t, spec=SPEC, step=1)
    assert_same_on_all_ranks(t)
    os.environ["QSDP_CHECK_CALLS"] = "0"
    u = x.clone()
    two_phase_all_reduce(u, spec=SPEC, step=1)
    assert torch.equal(t, u)
    os.environ["QSDP_CHECK_CALLS"] = "1"
    # rank 1 is asked for another length: every rank raises, naming it
    n = 300 if rank == 1 else 301
    out["length"] = _outcome(lambda: two_phase_all_reduce(x[:n].clone(), spec=SPEC))
    # rank 2's own checks refuse its input (a strided view): every rank raises with its error
    bad = torch.randn(602)[::2] if rank == 2 else x.clone()
    out["refused"] = _outcome(lambda: integer_all_reduce(bad))
    # rank 0 would make no exchange at all (an empty chunk): still agreed on the way out
    rows = torch.zeros(world * (0 if rank == 0 else 4))
    mine = torch.zeros(0 if rank == 0 else 4)
    out["empty"] = _outcome(lambda: reduce_scatter(mine, rows, spec=SPEC))
    # another quantizer on rank 1 (payload sizes might even match): refused everywhere
    spec = (
        SPEC
        if rank != 1
        else QuantSpec(bits=4, group_size=32, scheme="minmax", rounding="stochastic")
    )
    gathered = torch.empty(world * 64)
    out["spec"] = _outcome(lambda: all_gather(gathered, x[:64].clone(), spec=spec))
    # and the next good call still runs on every rank
    t = x.clone()
    two_phase_all_reduce(t, spec=SPEC)
    assert_same_on_all_ranks(t)
    return out


def test_a_call_refused_on_one_rank_raises_on_every_rank():
    results = run_distributed(_checked, 3, pg_timeout_s=60)
    for out in results:
        assert "two_phase_all_reduce: the ranks were asked for different calls" in out["length"]
        assert "rank 1:" in out["length"] and "(300,)" in out["length"], out["length"]
        assert "integer_all_reduce was refused on 1 of 3 ranks" in out["refused"], out["refused"]
        assert "rank 2: ValueError" in out["refused"] and "contiguous" in out["refused"]
        assert "reduce_scatter: the ranks were asked for different calls" in out["empty"], out
        assert "group_size=32" in out["spec"] and "rank 1:" in out["spec"], out["spec"]
    assert len({tuple(sorted(o.items())) for o in results}) == 1  # the same errors everywhere


def _ddp_checked(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qsdp

    from ..models import classifier, train

    runs = []
    for check in ("0", "1"):
        os.environ["QSDP_CHECK_CALLS"] = check
        ddp = DDP(classifier(), bucket_cap_mb=0.01)  # several buckets, a policy split each
        qsdp.ddp.register(ddp, "cgx", error_feedback=True, schedule=qsdp.Schedule(pipeline=True))
        runs.append(train(ddp, rank, 4))
        ddp2 = DDP(classifier(), bucket_cap_mb=0.01)
        qsdp.ddp.register(ddp2, "global-qsgd")
        runs.append(train(ddp2, rank, 4))
    os.environ["QSDP_CHECK_CALLS"] = "0"
    assert runs[0] == runs[2] and runs[1] == runs[3], runs  # checking changes nothing


def test_checked_calls_through_the_ddp_hook_change_nothing():
    run_distributed(_ddp_checked, 3)
