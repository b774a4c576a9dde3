"""StepInBackward: staleness 1's optimizer step per FSDP module in the backward, the next
step's gathers started there ([Note: the step in the backward]).

The reference is the plain staleness-1 loop (backward; clip; ``optimizer.step()``, with
``WeightPrediction`` for ``predict="last"``): the same losses, parameters, noise keys and bytes,
bit for bit, on every rank; every module steps inside the backward (the root's in FSDP2's final
callback), and with the prefetch each forward's gather is served from what the backward
gathered."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import qsdp
from qsdp.testing import run_distributed

from ..models import batch, classifier

STEPS = 6
CLIP = 0.05  # binds: the classifier's gradient norms are larger


def _build(recipe: str, mesh):
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    qsdp.compress_fsdp(model, qsdp.recipe(recipe, staleness=1))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _loss(model: nn.Module, rank: int, step: int, scale: float = 1.0) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y) * scale


def _plain(recipe: str, mesh, rank: int, *, predict: str, clip: float | None):
    model, opt = _build(recipe, mesh)
    state = qsdp.fsdp.comm_state(model)
    prediction = qsdp.WeightPrediction(opt) if predict == "last" else None
    losses = []
    for step in range(STEPS):
        ahead = prediction.ahead(enabled=state.in_flight) if prediction else contextlib.nullcontext()
        with ahead:
            loss = _loss(model, rank, step)
            loss.backward()
        losses.append(float(loss.detach()))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if prediction:  # StepInBackward predicted for a next step too: settle() took it back
        with prediction.ahead(enabled=state.in_flight):  # (x + u - u: the same rounding)
            pass
    state.drain()
    opt.step()
    return model, losses


def _in_backward(recipe: str, mesh, rank: int, *, predict: str, clip: float | None, prefetch):
    model, opt = _build(recipe, mesh)
    state = qsdp.fsdp.comm_state(model)
    sib = qsdp.fsdp.StepInBackward(model, opt, clip=clip, predict=predict, prefetch=prefetch)
    losses, stepped = [], []
    for step in range(STEPS):
        loss = _loss(model, rank, step)
        loss.backward()
        losses.append(float(loss.detach()))
        done = sib.finish()
        stepped.append(done is not None)
        if done is None and not state.applied_nothing:
            opt.step()
        opt.zero_grad(set_to_none=True)
    sib.settle()
    state.drain()
    opt.step()
    assert stepped == [False] + [True] * (STEPS - 1), stepped  # the first applies nothing
    assert sib.late == 0  # every module stepped inside the backward, the root's too
    return model, losses


def _same(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    cases = [
        ("sdp4bit", "last", CLIP, True),
        ("sdp4bit", "none", None, True),
        ("sdp4bit", "last", None, False),
        ("qsdp-w8g8", "none", CLIP, False),
    ]
    for recipe, predict, clip, prefetch in cases:
        want, want_losses = _plain(recipe, mesh, rank, predict=predict, clip=clip)
        got, losses = _in_backward(
            recipe, mesh, rank, predict=predict, clip=clip, prefetch=prefetch
        )
        case = (recipe, predict, clip, prefetch, rank)
        assert losses == want_losses, (case, losses, want_losses)
        for (name, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
            assert torch.equal(p.to_local(), q.to_local()), (case, name)
        # the same collectives: the plain loop's bytes (flags agreed once a step either way),
        # and with the prefetch one more gather per module: the last step's, for a next step
        a, b = qsdp.fsdp_comm_stats(got).snapshot(), qsdp.fsdp_comm_stats(want).snapshot()
        gathers = "all_gather_diff" if recipe == "sdp4bit" else "all_gather"
        extra = len(_gathers(got)) if prefetch else 0
        assert a[gathers].calls == b[gathers].calls + extra, (case, a, b)
        assert (a[gathers].bytes > b[gathers].bytes) == bool(extra), (case, a, b)
        for name in ("reduce_scatter", "nonfinite_check"):
            assert a[name].bytes == b[name].bytes, (case, name, a, b)
        if recipe == "sdp4bit":
            stats = qsdp.fsdp.comm_state(got)
            cached = [g.cached_gathers for g in _gathers(got)]
            plain = [g.cached_gathers for g in _gathers(want)]
            # with the prefetch every forward after a step in the backward is served from it
            extra = STEPS - 2 if prefetch else 0
            assert cached == [c + extra for c in plain], (case, cached, plain)
            assert stats is not None


def _gathers(model: nn.Module) -> list:
    from qsdp.fsdp._state import _installed

    return _installed(model).gathers


def test_the_step_in_the_backward_is_the_plain_loops_step_bit_for_bit():
    run_distributed(_same, 3)


def _nan(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _build("sdp4bit", mesh)
    sib = qsdp.fsdp.StepInBackward(model, opt, clip=CLIP, predict="last")
    seen = []
    for step in range(3):
        before = [p.to_local().clone() for p in model.parameters()]
        try:  # rank 1's gradient of step 1 is NaN; it is applied (and judged) in step 2
            scale = float("nan") if (rank, step) == (1, 1) else 1.0
            _loss(model, rank, step, scale).backward()
            sib.finish()
            seen.append("ok")
        except ValueError as err:
            assert "non-finite gradient" in str(err) and "no parameter moved" in str(err), err
            after = [p.to_local() for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before)), "a parameter moved"
            seen.append("raised")
        opt.zero_grad(set_to_none=True)
    return seen


def test_a_nan_raises_on_every_rank_before_any_parameter_moves():
    results = run_distributed(_nan, 3)
    assert results == [["ok", "ok", "raised"]] * 3, results


def _refusals(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _build("qsdp-w8g8", mesh)
    with pytest.raises(ValueError, match="no gather that keeps what it gathered"):
        qsdp.fsdp.StepInBackward(model, opt, prefetch=True)
    with pytest.raises(ValueError, match="predict='local'"):
        qsdp.fsdp.StepInBackward(model, opt, predict="local", prefetch=False)
    other = torch.optim.AdamW([next(model.parameters())], lr=1e-3)
    with pytest.raises(ValueError, match="exactly the model's trainable parameters"):
        qsdp.fsdp.StepInBackward(model, other, prefetch=False)
    sync = classifier()
    fully_shard(sync, mesh=mesh)
    qsdp.compress_fsdp(sync, qsdp.recipe("sdp4bit"))
    with pytest.raises(ValueError, match="staleness=1"):
        qsdp.fsdp.StepInBackward(sync, torch.optim.AdamW(sync.parameters()))
    sib = qsdp.fsdp.StepInBackward(model, opt, prefetch=False)
    for step in range(2):  # a forgotten finish() is named in the next backward
        _loss(model, rank, step).backward()
    with pytest.raises(RuntimeError, match="call sib.finish\\(\\) after every backward"):
        _loss(model, rank, 2).backward()
    assert dist.get_world_size() == world


def test_refusals_name_the_fix():
    run_distributed(_refusals, 2)
