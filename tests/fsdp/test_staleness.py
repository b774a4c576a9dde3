"""Staleness 1 under FSDP2 and compressed HSDP: each step applies the previous step's reduction.

The reference is the synchronous model with the delay done by hand (the gradient a backward
leaves in ``.grad`` is kept and applied one step later, zeros on the first step): staleness 1 must
give the same parameters bit for bit, on every rank, through ``drain``, a resume from the saved
state, and the twin communicators the delayed reductions run on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import qsdp
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import (
    batch,
    classifier,
    flag_groups,
    train_delayed_by_hand,
    train_gated,
    train_gated_by_hand,
)

STEPS = 6


def _build(recipe: str, staleness: int, *, mesh=None, replicate=None, two_level=None):
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    schedule = qsdp.Schedule(staleness=staleness, start=0, predict="none")
    qsdp.compress_fsdp(model, recipe, replicate=replicate, mesh=two_level, schedule=schedule)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _backward(model: nn.Module, rank: int, step: int, scale: float = 1.0) -> None:
    x, y = batch(rank, step)
    (nn.functional.cross_entropy(model(x), y) * scale).backward()


def _stale_run(model, opt, rank: int, steps: range) -> list[bool]:
    state = qsdp.fsdp.comm_state(model)
    skipped = []
    for step in steps:
        _backward(model, rank, step)
        skipped.append(state.applied_nothing)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return skipped


def _local(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _compare(rank: int, recipe: str, **where) -> None:
    sync, opt = _build(recipe, 0, **where)
    train_delayed_by_hand(sync, opt, lambda step: _backward(sync, rank, step), STEPS)
    want = _local(sync)
    stale, opt = _build(recipe, 1, **where)
    skipped = _stale_run(stale, opt, rank, range(STEPS))
    assert skipped == [True] + [False] * (STEPS - 1), skipped
    state = qsdp.fsdp.comm_state(stale)
    state.drain()
    opt.step()
    state.drain()  # nothing left in flight: a no-op
    for got, w in zip(_local(stale), want, strict=True):
        assert torch.equal(got, w), (recipe, rank, (got - w).abs().max())
    for p in stale.parameters():  # the replicas of each shard (every rank for FSDP) agree
        group = where["replicate"].get_group(0) if where.get("replicate") else None
        if group is not None:
            assert_same_on_all_ranks(p.to_local().detach(), group=group)


def _flat(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for recipe in ("bf16", "qsdp-w8g8", "global-qsgd", "sdp4bit"):
        _compare(rank, recipe, mesh=mesh)


def test_fsdp_staleness_1_applies_the_synchronous_gradients_one_step_late():
    run_distributed(_flat, 3)


def _meshes(rank: int, world: int) -> None:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for recipe in ("cgx", "global-qsgd"):
        _compare(rank, recipe, mesh=hsdp["shard"], replicate=hsdp["replicate"])
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    _compare(rank, "sdp4bit", two_level=two)


def test_staleness_1_on_hsdp_and_a_two_level_mesh():
    run_distributed(_meshes, 4)


def _resume(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    straight, opt = _build("qsdp-w8g8", 1, mesh=mesh)
    _stale_run(straight, opt, rank, range(STEPS))
    first, opt = _build("qsdp-w8g8", 1, mesh=mesh)
    _stale_run(first, opt, rank, range(3))
    comm = qsdp.fsdp.comm_state(first).state_dict()
    assert int(comm["pending"]) == 1
    saved = {
        "model": {k: v.clone() for k, v in first.state_dict().items()},
        "opt": opt.state_dict(),
        "comm": {k: v.clone() for k, v in comm.items()},
    }
    resumed, opt = _build("qsdp-w8g8", 1, mesh=mesh)
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    qsdp.fsdp.comm_state(resumed).load_state_dict(saved["comm"])
    skipped = _stale_run(resumed, opt, rank, range(3, STEPS))
    assert skipped == [False] * (STEPS - 3)  # the saved reduction is applied at once
    for a, b in zip(_local(resumed), _local(straight), strict=True):
        assert torch.equal(a, b)


def test_resume_continues_exactly_with_the_reduction_in_flight():
    run_distributed(_resume, 3)


def _nan(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _build("qsdp-w8g8", 1, mesh=mesh)
    seen = []
    for step in range(4):
        # rank 1's gradient of step 1 is NaN; it is applied (zeroed on the device) in step 2,
        # and the host reads that verdict when the backward of step 3 ends ([Note: the verdict
        # read one backward later] in qsdp.runtime.nonfinite)
        try:
            _backward(model, rank, step, scale=float("nan") if (rank, step) == (1, 1) else 1.0)
            seen.append("ok")
        except ValueError as err:
            assert "non-finite gradient" in str(err) and "5.weight" in str(err), err
            seen.append("raised")
            break
        opt.step()
        opt.zero_grad(set_to_none=False)
        seen[-1] += "" if all(bool(torch.isfinite(p).all()) for p in _local(model)) else " nan"
    return seen


def test_a_nan_raises_on_every_rank_one_backward_after_the_step_that_applies_it():
    results = run_distributed(_nan, 3)
    assert results == [["ok", "ok", "ok", "raised"]] * 3, results


def _nan_predicted(rank: int, world: int) -> list[float]:
    # staleness 1 as shipped (predicting from each rank's own gradient), nonfinite="zero":
    # rank 1's gradient of step 1 is NaN; its reduction is zeroed when applied in step 2, and
    # its estimate must not reach step 2's predicted weights ([Note: a non-finite estimate
    # predicts nothing] in qsdp.runtime.adam_step): every later loss was NaN before
    mesh = init_device_mesh("cpu", (world,))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    config = qsdp.recipe("qsdp-w8g8", nonfinite="zero")
    qsdp.compress_fsdp(model, config, schedule=qsdp.Schedule(staleness=1, start=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = qsdp.fsdp.comm_state(model)
    losses = []
    for step in range(6):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        (loss * (float("nan") if (rank, step) == (1, 1) else 1.0)).backward()
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert_same_on_all_ranks(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
    return losses


def test_a_nan_gradient_never_reaches_the_predicted_weights():
    for losses in run_distributed(_nan_predicted, 3):
        assert all(math.isfinite(v) for v in losses), losses


def _refusals(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _build("bf16", 0, mesh=mesh)
    with pytest.raises(ValueError, match="drain\\(\\) is for staleness=1"):
        qsdp.fsdp.comm_state(model).drain()
    assert not qsdp.fsdp.comm_state(model).applied_nothing
    assert dist.get_world_size() == world


def test_drain_is_refused_at_staleness_0():
    run_distributed(_refusals, 2)


def _gated(rank: int, world: int) -> list[bool]:
    mesh = init_device_mesh("cpu", (world,))
    sync, opt = _build("global-qsgd", 0, mesh=mesh)
    train_gated_by_hand(sync, opt, lambda step: _backward(sync, rank, step))
    stale, opt = _build("global-qsgd", 1, mesh=mesh)
    state = qsdp.fsdp.comm_state(stale)
    fired = train_gated(stale, opt, state, lambda step: _backward(stale, rank, step))
    for got, w in zip(_local(stale), _local(sync), strict=True):
        assert torch.equal(got, w), (got - w).abs().max()
    return fired


def test_the_gate_drains_and_the_next_step_is_the_synchronous_one():
    fired = run_distributed(_gated, 3)
    assert fired == [[False, True, False, False, True]] * 3, fired


def _own_group(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for recipe in ("qsdp-w8g8", "bf16"):
        runs = []
        for own in (False, True):
            model = classifier()
            for i in (2, 5):
                fully_shard(model[i], mesh=mesh)
            fully_shard(model, mesh=mesh)
            qsdp.compress_fsdp(model, recipe, schedule=qsdp.Schedule(own_reduce_group=own))
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            for step in range(3):
                _backward(model, rank, step)
                opt.step()
                opt.zero_grad()
            hooks = qsdp.fsdp._state._installed(model).hooks
            reduce = [h for h in hooks if hasattr(h, "twins")]
            # a twin of FSDP's group for every reduce-scatter hook, or none at all
            assert all(bool(h.twins) == own for h in reduce) and (reduce or not own)
            runs.append(_local(model))
        for a, b in zip(*runs, strict=True):  # the same collectives on another communicator
            assert torch.equal(a, b), recipe
    with pytest.raises(ValueError, match="own_reduce_group is for FSDP2"):
        qsdp.ddp.register(
            torch.nn.parallel.DistributedDataParallel(classifier()),
            "cgx",
            schedule=qsdp.Schedule(own_reduce_group=True),
        )
    # the default: on for weights gathered again in the backward (qsdp-w8g8), else off
    assert qsdp.Schedule().own_group(qsdp.recipe("qsdp-w8g8"))
    assert not qsdp.Schedule().own_group(qsdp.recipe("sdp4bit"))
    assert not qsdp.Schedule(own_reduce_group=False).own_group(qsdp.recipe("qsdp-w8g8"))


def test_own_reduce_group_reduces_the_same_on_a_second_communicator():
    run_distributed(_own_group, 3)


def _flag_groups(rank: int, world: int) -> None:
    # [Note: flags agreed where they were reduced]: a result's flags are agreed over the
    # reductions' own communicator when the backward that sent it ends, all of that backward's
    # in one all-reduce, never over FSDP2's group at the end of the backward that applies them
    # (where the compute stream would wait for it) nor between two hooks; drain(), outside a
    # backward, agrees the drained results' at once, over FSDP2's group
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _build("qsdp-w8g8", 1, mesh=mesh)
    fsdp_group = mesh.get_group()
    hooks = [h for h in qsdp.fsdp._state._installed(model).hooks if hasattr(h, "twins")]
    twin = hooks[0].twins[fsdp_group.group_name]
    assert twin is not fsdp_group
    with flag_groups() as seen:
        _stale_run(model, opt, rank, range(3))
    assert seen == [twin, twin, twin], seen  # one per backward, each step sends
    with flag_groups() as seen:
        qsdp.fsdp.comm_state(model).drain()
    assert len(seen) == 3 and all(g is fsdp_group for g in seen), seen  # one per group


def test_staleness_1_agrees_the_applied_flags_once_per_backward():
    run_distributed(_flag_groups, 3)


def _hsdp_flag_groups(rank: int, world: int) -> None:
    # compressed HSDP: the applied result's flags are agreed over the shard group, then over the
    # replicate group (every rank then reaches the same verdict, even if replicas differed),
    # once per backward and, in drain(), once per module
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard, replicate = hsdp["shard"].get_group(), hsdp["replicate"].get_group()
    model, opt = _build("cgx", 1, mesh=hsdp["shard"], replicate=hsdp["replicate"])
    with flag_groups() as seen:
        _stale_run(model, opt, rank, range(3))  # the first step applies nothing
    assert seen == [shard, replicate, shard, replicate], seen
    with flag_groups() as seen:
        qsdp.fsdp.comm_state(model).drain()
    assert seen == [shard, replicate] * (len(seen) // 2) and len(seen) >= 2, seen


def test_staleness_1_under_hsdp_agrees_the_applied_flags_over_every_rank():
    run_distributed(_hsdp_flag_groups, 4)
