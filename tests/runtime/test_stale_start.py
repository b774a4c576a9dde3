"""When staleness 1 starts (``Schedule.start``, ``qsdp.runtime.StaleStart``): the settled-norm
criterion on its own, counted backwards, and under FSDP2 and DDP on gloo: synchronous (the bits
of staleness 0) until the start, then the delayed schedule, at the same backward on every rank;
a checkpoint keeps where it stands."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.runtime.stale_start import SETTLED, WINDOW, StaleStart, _settled
from qsdp.testing import run_distributed

from ..models import batch, classifier


def test_settled_needs_two_windows_within_the_factor():
    flat = [1.0] * (2 * WINDOW)
    assert not _settled(flat[:-1]) and _settled(flat)
    falling = [0.9**i for i in range(2 * WINDOW)]  # 0.9^10 = 0.35: not settled
    assert not _settled(falling)
    # a spike in each window moves neither median
    spiky = [1.0] * (2 * WINDOW)
    spiky[3], spiky[WINDOW + 4] = 100.0, 1e-3
    assert _settled(spiky)
    edge = [1.0] * WINDOW + [SETTLED] * WINDOW
    assert _settled(edge) and not _settled([1.0] * WINDOW + [SETTLED * 1.01] * WINDOW)
    assert not _settled([1.0] * WINDOW + [float("nan")] * WINDOW)
    assert not _settled([0.0] * (2 * WINDOW))


def _backwards(start: StaleStart, norms: list[float]) -> list[bool]:
    """One backward per norm, each handing ``start`` a gradient of that norm (its ``started``
    after each)."""
    out = []
    for norm in norms:
        w = torch.ones(4, requires_grad=True)
        w.register_hook(lambda g, n=norm: start.observe(torch.full((4,), n / 2.0), None))
        (w * 1.0).sum().backward()
        out.append(start.started)
    return out


def test_auto_starts_one_backward_after_two_settled_windows():
    start = StaleStart("auto")
    # halving for 15 backwards (2^15 ... 2), then flat at 1: the medians agree once the earlier
    # window holds six flat norms (31 read); backward t's norm is read when t + 1 ends
    norms = [2.0 ** (15 - i) for i in range(15)] + [1.0] * 40
    started = _backwards(start, norms)
    first = started.index(True)
    assert first == 31 == 15 + WINDOW + WINDOW // 2 + 1
    assert start.started_at == first + 1 and start.backwards == first + 1
    assert start.norms[-1] == pytest.approx(1.0)
    assert all(started[first:])
    # never settles: stays synchronous
    never = StaleStart("auto")
    assert not any(_backwards(never, [1.5**i for i in range(60)]))


def test_a_count_starts_after_that_many_backwards_and_zero_at_once():
    start = StaleStart(3)
    assert _backwards(start, [1.0] * 5) == [False, False, True, True, True]
    assert start.started_at == 3 and start.norms == []  # (a count measures nothing)
    assert StaleStart(0).started and StaleStart(0).started_at == 0


def test_state_round_trips_and_bad_starts_are_refused():
    start = StaleStart("auto")
    _backwards(start, [2.0, 3.0, 4.0])
    state = start.state_dict()
    assert state["norms"].shape == (2 * WINDOW,)  # fixed size: checkpoints load into it
    again = StaleStart("auto")
    again.load_state_dict(state)
    assert again.norms == start.norms == [2.0, 3.0] and again.backwards == 3
    assert not again.started
    for bad in (-1, 1.5, True, "soon"):
        with pytest.raises(ValueError, match="must be 'auto'"):
            qsdp.Schedule(staleness=1, start=bad)
    with pytest.raises(ValueError, match="with staleness=0 every step is synchronous"):
        qsdp.Schedule(start=5)
    assert qsdp.Schedule().start == "auto" and qsdp.Schedule(start=0).start == 0


# --- under FSDP2 and DDP (gloo) -------------------------------------------------------------
def _run(rank: int, kind: str, start: int | str, steps: int) -> dict:
    torch.manual_seed(0)
    model = classifier()
    if kind == "fsdp":
        for i in (2, 5):
            fully_shard(model[i])
        fully_shard(model)
        qsdp.compress_fsdp(
            model, "sdp4bit", schedule=qsdp.Schedule(staleness=1, start=start, predict="none")
        )
        state = qsdp.fsdp.comm_state(model)
    else:
        model = DDP(model)
        state = qsdp.ddp.register(
            model, "cgx", schedule=qsdp.Schedule(staleness=1, start=start, predict="none")
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    skipped, since = [], []
    for step in range(steps):
        x, y = batch(rank, step % 2)  # two batches in turn: the norm settles at once
        nn.functional.cross_entropy(model(x), y).backward()
        skipped.append(state.applied_nothing)
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
        since.append(state.delayed_since)
    params = [
        (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()
    ]
    return {"skipped": skipped, "since": since, "params": params}


def _worker(rank: int, world: int, kind: str) -> bool:
    steps = 2 * WINDOW + 4
    auto = _run(rank, kind, "auto", steps)
    first = auto["since"].index(next(s for s in auto["since"] if s is not None))
    # synchronous until the start: nothing skipped, then the start's backward applies nothing
    assert auto["skipped"] == [False] * (first + 1) + [True] + [False] * (steps - first - 2)
    assert auto["since"][first] == first + 1 == 2 * WINDOW + 1
    counted = _run(rank, kind, first + 1, steps)  # the same start by count: the same bits
    assert counted["skipped"] == auto["skipped"]
    for a, b in zip(auto["params"], counted["params"], strict=True):
        assert torch.equal(a, b)
    everyone = [None] * world
    dist.all_gather_object(everyone, (auto["since"], auto["skipped"]))
    assert all(e == everyone[0] for e in everyone)  # every rank started at the same backward
    return True


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_auto_start_is_synchronous_first_and_the_same_on_every_rank(kind):
    assert all(run_distributed(_worker, 3, kind, timeout_s=300))
