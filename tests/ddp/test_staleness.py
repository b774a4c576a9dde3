"""Staleness 1 in qsdp.ddp: each step applies the previous step's reduced gradient.

The reference is the synchronous hook with the delay done by hand (the gradient a backward
leaves in ``.grad`` is kept and applied one step later, zeros on the first step): staleness 1
must give the same parameters bit for bit, through DDP's bucket rebuild, on every rank."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import batch, classifier, train_delayed_by_hand, train_gated, train_gated_by_hand

STEPS = 7


def _loss(ddp: DDP, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(ddp(x), y)


def _build(recipe: str, staleness: int):
    ddp = DDP(classifier(), bucket_cap_mb=0.01)  # several buckets, rebuilt after the first step
    hook = qsdp.ddp.register(
        ddp, recipe, schedule=qsdp.Schedule(staleness=staleness, start=0, predict="none")
    )
    return ddp, hook, torch.optim.AdamW(ddp.parameters(), lr=3e-3)


def _stale(rank: int, recipe: str, steps: range, state=None):
    ddp, hook, opt = _build(recipe, 1)
    if state is not None:
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        hook.load_state_dict(state["hook"])
    for step in steps:
        _loss(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return ddp, hook, opt


def _by_hand(rank: int, recipe: str) -> list[torch.Tensor]:
    ddp, _, opt = _build(recipe, 0)
    train_delayed_by_hand(ddp, opt, lambda step: _loss(ddp, rank, step).backward(), STEPS)
    return [p.detach().clone() for p in ddp.parameters()]


def _same_as_by_hand(rank: int, world: int, recipe: str) -> None:
    want = _by_hand(rank, recipe)
    ddp, hook, opt = _stale(rank, recipe, range(STEPS))
    hook.drain()
    opt.step()
    hook.drain()  # nothing left in flight: a no-op
    for p, w in zip(ddp.parameters(), want, strict=True):
        assert torch.equal(p.detach(), w), (recipe, rank)
        assert_same_on_all_ranks(p.detach())


@pytest.mark.parametrize("recipe", ["bf16", "cgx", "global-qsgd"])
def test_staleness_1_applies_the_synchronous_gradients_one_step_late(recipe):
    run_distributed(_same_as_by_hand, 3, recipe)


def _resume(rank: int, world: int) -> None:
    straight, hook, opt = _stale(rank, "bf16", range(STEPS))
    hook.drain()
    opt.step()
    first, hook, opt = _stale(rank, "bf16", range(3))
    state = {  # the in-flight reduction goes into the checkpoint
        "model": {k: v.clone() for k, v in first.module.state_dict().items()},
        "opt": opt.state_dict(),
        "hook": {k: v.clone() for k, v in hook.state_dict().items()},
    }
    assert int(state["hook"]["pending"]) == 1
    resumed, hook, opt = _stale(rank, "bf16", range(3, STEPS), state=state)
    hook.drain()
    opt.step()
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_resume_continues_exactly():
    # 2 ranks: a sum of two floats does not depend on the bucket layout, which DDP rebuilds
    run_distributed(_resume, 2)


def _nan_late(rank: int, world: int) -> tuple[int, str, float]:
    ddp, hook, opt = _build("cgx", 1)
    for step in range(4):
        loss = _loss(ddp, rank, step)
        if step == 1 and rank == world - 1:
            loss = loss * float("nan")
        start = time.monotonic()
        try:
            loss.backward()
        except Exception as e:  # DDP re-raises the hook future's error
            return step, str(e), time.monotonic() - start
        opt.step()
        opt.zero_grad(set_to_none=False)
    return -1, "no error", 0.0


def test_nan_raises_on_every_rank_one_backward_after_its_gradient_is_applied():
    results = run_distributed(_nan_late, 3, pg_timeout_s=30)
    # step 1's NaN is applied (zeroed on the device) by step 2; the host reads that verdict
    # when the backward of step 3 ends, and raises there, on every rank alike
    assert {step for step, _, _ in results} == {3}, results
    assert len({msg for _, msg, _ in results}) == 1
    assert "non-finite gradient" in results[0][1]
    assert max(t for _, _, t in results) < 5


def _nan_predicted(rank: int, world: int) -> list[float]:
    """Staleness 1 as shipped (predicting from each rank's own gradient) under
    ``nonfinite="zero"``: the last rank's gradient of step 1 is NaN; the run goes on finite
    ([Note: a non-finite estimate predicts nothing] in qsdp.runtime.adam_step)."""
    ddp = DDP(classifier(), bucket_cap_mb=0.01)
    config = qsdp.recipe("cgx", nonfinite="zero")
    hook = qsdp.ddp.register(ddp, config, schedule=qsdp.Schedule(staleness=1, start=0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        loss = _loss(ddp, rank, step)
        (loss * (float("nan") if (rank, step) == (world - 1, 1) else 1.0)).backward()
        if not hook.applied_nothing:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert_same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    return losses


def test_a_nan_gradient_never_reaches_the_predicted_weights():
    for losses in run_distributed(_nan_predicted, 3, pg_timeout_s=30):
        assert all(math.isfinite(v) for v in losses), losses


def _nan_drained(rank: int, world: int) -> tuple[str, int, bool]:
    """The last step's gradient is NaN on one rank only; it is still in flight when the
    training ends: drain() checks it as it applies it."""
    ddp, hook, opt = _build("cgx", 1)
    for step in range(2):
        loss = _loss(ddp, rank, step)
        if step == 1 and rank == 0:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    try:
        hook.drain()
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    zeroed = all(bool((p.grad == 0).all()) for p in ddp.parameters())
    return message, hook.zeroed, zeroed


def test_a_drained_nan_raises_on_every_rank_and_is_never_applied():
    results = run_distributed(_nan_drained, 3, pg_timeout_s=30)
    assert len({msg for msg, _, _ in results}) == 1, results
    assert "non-finite gradient" in results[0][0] and "drained" in results[0][0]
    # every bucket of the drained step held NaN (the average takes rank 0's): all zeroed
    assert all(zeroed for _, _, zeroed in results)
    assert {n for _, n, _ in results} == {results[0][1]} and results[0][1] >= 1


def _refusals(rank: int, world: int) -> None:
    ddp = DDP(classifier())
    hook = qsdp.ddp.register(ddp, "cgx")
    with pytest.raises(ValueError, match="drain\\(\\) is for staleness=1"):
        hook.drain()
    with pytest.raises(ValueError, match="synchronous\\(\\) is for staleness=1"):
        with hook.synchronous():
            pass
    assert not hook.applied_nothing
    stale, hook, _ = _build("bf16", 1)
    _loss(stale, rank, 0).backward()  # a reduction in flight: a synchronous step would lose it
    with pytest.raises(RuntimeError, match="call drain\\(\\)"):
        with hook.synchronous():
            _loss(stale, rank, 1).backward()
    dist.barrier()


def test_refusals():
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ValueError, match="staleness"):
            qsdp.Schedule(staleness=bad)
    # staleness says when, not what: a recipe override names where it went
    with pytest.raises(TypeError, match=r"schedule=qsdp.Schedule\(staleness=1\)"):
        qsdp.recipe("cgx", staleness=1)
    run_distributed(_refusals, 1)


def _gated(rank: int, world: int) -> list[bool]:
    ddp, _, opt = _build("cgx", 0)
    train_gated_by_hand(ddp, opt, lambda step: _loss(ddp, rank, step).backward())
    want = [p.detach().clone() for p in ddp.parameters()]
    stale, hook, opt = _build("cgx", 1)
    fired = train_gated(stale, opt, hook, lambda step: _loss(stale, rank, step).backward())
    for p, w in zip(stale.parameters(), want, strict=True):
        assert torch.equal(p.detach(), w)
    return fired


def test_the_gate_drains_and_the_next_step_is_the_synchronous_one():
    fired = run_distributed(_gated, 3)
    assert fired == [[False, True, False, False, True]] * 3, fired


def _predicted(rank: int, world: int) -> list[float]:
    """Staleness 1 with weight prediction against the delay and the prediction done by hand
    around the synchronous hook: the same parameters bit for bit, replicas identical."""
    ddp, hook, opt = _build("cgx", 1)
    prediction = qsdp.WeightPrediction(opt)
    shifted = []
    for step in range(STEPS):
        shifted.append(hook.in_flight and prediction.update is not None)
        with prediction.ahead(enabled=hook.in_flight):
            _loss(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    hook.drain()
    opt.step()
    sync, _, ref_opt = _build("cgx", 0)
    ref_prediction = qsdp.WeightPrediction(ref_opt)

    def backward(step: int) -> None:  # ahead from the second step (the first update) on
        with ref_prediction.ahead(enabled=step > 0):
            _loss(sync, rank, step).backward()

    train_delayed_by_hand(sync, ref_opt, backward, STEPS)
    for p, w in zip(ddp.parameters(), sync.parameters(), strict=True):
        assert torch.equal(p.detach(), w.detach()), rank
        assert_same_on_all_ranks(p.detach())
    return shifted


def test_weight_prediction_computes_ahead_and_keeps_replicas_identical():
    for shifted in run_distributed(_predicted, 3):
        # step 0: nothing in flight; from step 1 on a reduction is in flight and there is an
        # update (step 0's optimizer step on zeros, as the delay by hand takes it: weight decay)
        assert shifted == [False] + [True] * (STEPS - 1), shifted
