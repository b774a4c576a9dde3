"""Adaptive widths in the hooks (FSDP2 reduce-scatter, DDP buckets): the plan is decided in a
measuring backward, is the same on every rank, is applied (bytes on the wire follow each
group's width), survives a checkpoint, and trains like the uniform width."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.config import AdaptiveWidths
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import batch, classifier, train

ADAPT = AdaptiveWidths(every=3, warmup=1, sample=4096)  # widths 2, 3, 4, 6 and 8


def _fsdp(recipe: str, adaptive):
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i])
    fully_shard(model)
    qsdp.compress_fsdp(model, qsdp.recipe(recipe, adaptive=adaptive))
    return model


def _expected_bytes(model, ws: int) -> int:
    """The reduce-scatter bytes of one step at each hook's current width."""
    inst = qsdp.fsdp._state._installed(model)
    total = 0
    for h in inst.hooks:
        if not hasattr(h, "width_key"):
            continue
        numel = ws * sum(n for _, n in h.layout)
        plan = h.plan.with_bits(inst.widths.width(h.width_key))
        total += plan.reduce_scatter_wire_bytes(numel, ws, split=h.split)
    return total


def _fsdp_worker(rank: int, world: int) -> dict:
    init_device_mesh("cpu", (world,))
    model = _fsdp("cgx", ADAPT)
    state = qsdp.fsdp.comm_state(model)
    out = {"adaptive": train(model, rank, 25)[-1]}
    widths = state.widths
    assert (widths.decisions, widths.steps) == (8, 25), (widths.decisions, widths.steps)
    assert widths.plan.bytes <= widths.plan.reference_bytes
    assert widths.plan.error <= widths.plan.reference_error * (1 + 1e-9)
    saved = state.state_dict()
    assert_same_on_all_ranks(saved["widths"])  # rank 0's plan everywhere
    # the hooks reduce at the plan's widths: force a mixed plan and count one step's bytes
    forced = saved["widths"].clone()
    forced[:] = torch.tensor([3, 6, 2])[: forced.numel()]  # 3 and 6 bits: 3-byte words
    state.load_state_dict(saved | {"widths": forced, "width_steps": torch.tensor([2])})
    stats = qsdp.fsdp_comm_stats(model)
    before = stats["reduce_scatter"].bytes
    x, y = batch(rank, 99)
    nn.functional.cross_entropy(model(x), y).backward()
    assert stats["reduce_scatter"].bytes - before == _expected_bytes(model, world)
    uniform = stats["reduce_scatter"].bytes - before
    state.load_state_dict(saved | {"widths": torch.zeros_like(forced)})
    before = stats["reduce_scatter"].bytes
    nn.functional.cross_entropy(model(x), y).backward()
    assert stats["reduce_scatter"].bytes - before != uniform  # all at 4 bits now
    # resume: a fresh model takes the widths and the step count
    fresh = _fsdp("cgx", ADAPT)
    qsdp.fsdp.comm_state(fresh).load_state_dict(saved)
    assert qsdp.fsdp.comm_state(fresh).widths.widths == widths.widths
    assert qsdp.fsdp.comm_state(fresh).widths.steps == 25
    out["uniform"] = train(_fsdp("cgx", None), rank, 25)[-1]
    return out


def test_fsdp_adaptive_widths_agree_apply_resume_and_train():
    out = run_distributed(_fsdp_worker, 3, timeout_s=300)[0]
    assert abs(out["adaptive"] - out["uniform"]) < 0.05 * out["uniform"], out


def _ddp_worker(rank: int, world: int) -> float:
    ddp = DDP(classifier(), bucket_cap_mb=0.01)  # several buckets
    hook = qsdp.ddp.register(ddp, qsdp.recipe("cgx", adaptive=ADAPT))
    loss = train(ddp, rank, 10)[-1]
    assert hook.widths.decisions == 3 and hook.widths.widths
    for p in ddp.parameters():
        assert_same_on_all_ranks(p.detach())  # one plan: the same bytes and sums everywhere
    state = hook.state_dict()
    assert_same_on_all_ranks(state["widths"])
    # every bucket at its width: the counted bytes of one step
    before = hook.stats["two_phase_all_reduce"].bytes
    x, y = batch(rank, 99)
    nn.functional.cross_entropy(ddp(x), y).backward()
    assert hook.stats["two_phase_all_reduce"].bytes - before == hook.wire_bytes_per_step()
    return loss


def test_ddp_adaptive_widths_per_bucket():
    losses = run_distributed(_ddp_worker, 3)
    assert len(set(losses)) == 1


def test_bad_adaptive_settings_are_refused():
    with pytest.raises(ValueError, match="needs quantized gradients"):
        qsdp.recipe("global-qsgd", adaptive=AdaptiveWidths())
    with pytest.raises(ValueError, match="must include the gradients' own width 4"):
        qsdp.recipe("cgx", adaptive=AdaptiveWidths(widths=(2, 8)))
    with pytest.raises(ValueError, match="among \\(2, 3, 4, 6, 8\\)"):
        AdaptiveWidths(widths=(5, 4))
    with pytest.raises(ValueError, match="every=0 must be a positive int"):
        AdaptiveWidths(every=0)


def _nan_at_the_measuring_step(rank: int, world: int) -> tuple:
    ddp = DDP(classifier(), bucket_cap_mb=0.01)
    config = qsdp.recipe("cgx", adaptive=ADAPT, nonfinite="zero")
    hook = qsdp.ddp.register(ddp, config)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    for step in range(3):  # step 1 measures; rank `step` has a NaN gradient in it
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if step == 1 and rank == (world - 1 if world > 1 else 0):
            loss = loss * float("nan")
        loss.backward()  # no rank waits alone in the plan's broadcast, none raises
        opt.step()
        opt.zero_grad()
    assert hook.widths.decisions == 1 and hook.zeroed >= 1
    return tuple(sorted(hook.widths.widths.items()))


@pytest.mark.parametrize("world", [1, 3], ids=["rank0-nan", "rank2-nan"])
def test_a_nan_in_the_measuring_step_neither_hangs_nor_splits_the_plan(world):
    plans = run_distributed(_nan_at_the_measuring_step, world, pg_timeout_s=30)
    assert len(set(plans)) == 1
