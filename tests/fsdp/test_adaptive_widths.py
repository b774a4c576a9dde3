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


PER_PARAM = AdaptiveWidths(every=3, warmup=1, sample=4096, per_parameter=True)


def _one_group(adaptive, recipe: str = "cgx"):
    """The classifier as one FSDP2 group: its three matrices (compressed) and its biases and
    norm (raw) in one reduce-scatter."""
    model = classifier()
    fully_shard(model)
    qsdp.compress_fsdp(model, qsdp.recipe(recipe, adaptive=adaptive) if recipe else "bf16")
    return model


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def _per_parameter_worker(rank: int, world: int) -> dict:
    init_device_mesh("cpu", (world,))
    x, y = batch(rank, 7)
    # before any decision every parameter holds the reference width: one call, bit for bit
    # the per-group hook's
    late = AdaptiveWidths(warmup=100, per_parameter=True)
    a, b = _one_group(late), _one_group(None)
    for m in (a, b):
        nn.functional.cross_entropy(m(x), y).backward()
    assert all(torch.equal(g, h) for g, h in zip(_grads(a), _grads(b), strict=True))
    # training decides a width per matrix, the same on every rank
    model = _one_group(PER_PARAM)
    state = qsdp.fsdp.comm_state(model)
    loss = train(model, rank, 25)[-1]
    widths = state.widths
    assert widths.keys == 3 and widths.decisions == 8
    saved = state.state_dict()
    assert_same_on_all_ranks(saved["widths"])
    # a forced mixed plan: one reduce-scatter per width, the raw parameters with the first;
    # the bytes are those of the three calls
    hook = next(h for h in qsdp.fsdp._state._installed(model).hooks if hasattr(h, "param_keys"))
    sizes = {name: n for name, n in hook.layout}
    matrices = ["0.weight", "2.weight", "5.weight"]  # chunk order: embedding, fc1, fc2
    raw = sum(n for name, n in hook.layout if name not in matrices)
    stats = qsdp.fsdp_comm_stats(model)
    exact = _one_group(None, recipe=None)  # uncompressed FSDP2, the same weights
    exact.load_state_dict(model.state_dict())
    nn.functional.cross_entropy(exact(x), y).backward()
    for forced in ([3, 6, 2], [8, 6, 8]):
        state.load_state_dict(
            saved | {"widths": torch.tensor(forced), "width_steps": torch.tensor([2])}
        )
        model.zero_grad()
        before = (stats["reduce_scatter"].bytes, stats["reduce_scatter"].calls)
        nn.functional.cross_entropy(model(x), y).backward()
        spec = hook.plan.width_spec
        calls = {}
        for name, bits in zip(matrices, forced, strict=True):
            calls[bits] = calls.get(bits, 0) + sizes[name]
        want = 0
        for k, bits in enumerate(sorted(calls)):
            split = None
            if k == 0:  # the raw parameters travel with the narrowest width's codes
                n = calls[bits] + raw
                split = qsdp.comm.Split(
                    chunk=n, runs=((0, calls[bits], True), (calls[bits], raw, False))
                )
            want += qsdp.comm.reduce_scatter_wire_bytes(
                world * (calls[bits] + (raw if k == 0 else 0)),
                world,
                qsdp.quant.QuantSpec(**{**spec.__dict__, "bits": bits}),
                split=split,
            )
        got = stats["reduce_scatter"].bytes - before[0]
        assert got == want, (forced, got, want)
        assert stats["reduce_scatter"].calls - before[1] == len(calls)
        if forced == [8, 6, 8]:  # each matrix at its width: close to the exact gradient
            for (name, p), e in zip(model.named_parameters(), exact.parameters(), strict=True):
                g, ref = p.grad.to_local(), e.grad.to_local()
                if name in matrices:
                    assert (g - ref).norm() < 0.05 * ref.norm(), name
                else:  # raw: summed exactly
                    torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)
    return {"loss": loss, "uniform": train(_one_group(None), rank, 25)[-1]}


def test_widths_per_parameter_split_a_group_into_one_call_per_width():
    out = run_distributed(_per_parameter_worker, 3, timeout_s=300)[0]
    assert abs(out["loss"] - out["uniform"]) < 0.05 * out["uniform"], out


def _refused(rank: int, world: int) -> str:
    init_device_mesh("cpu", (world,))
    model = classifier()
    fully_shard(model)
    with pytest.raises(ValueError, match="per_parameter=True\\) is built for FSDP2's") as e:
        stale = qsdp.Schedule(staleness=1, start=0, predict="none")
        qsdp.compress_fsdp(model, qsdp.recipe("cgx", adaptive=PER_PARAM), schedule=stale)
    with pytest.raises(ValueError, match="DDP adapts a width per bucket"):
        qsdp.ddp.register(DDP(classifier()), qsdp.recipe("cgx", adaptive=PER_PARAM))
    return str(e.value)


def test_widths_per_parameter_are_for_fsdp2s_synchronous_reduce_scatter():
    assert len(set(run_distributed(_refused, 2))) == 1
    with pytest.raises(ValueError, match="per_parameter=1 must be a bool"):
        AdaptiveWidths(per_parameter=1)


class _TwoHeads(nn.Module):
    """One FSDP2 group whose second head is unused in a step: FSDP2 then reduce-scatters a
    shorter chunk than the group's layout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(self.body(x))


def _unused_parameter(rank: int, world: int) -> tuple:
    init_device_mesh("cpu", (world,))
    model = _TwoHeads()
    fully_shard(model)
    qsdp.compress_fsdp(
        model, qsdp.recipe("cgx", adaptive=AdaptiveWidths(warmup=10**6, per_parameter=True))
    )
    state = qsdp.fsdp.comm_state(model)
    state.load_state_dict(state.state_dict() | {"widths": torch.tensor([8, 6, 2])})
    stats = qsdp.fsdp_comm_stats(model)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    model(x, "a").sum().backward()  # head b has no gradient: one call at the reference width
    skipped = (stats["reduce_scatter"].calls, stats["widths_skipped"].calls)
    model.zero_grad()
    (model(x, "a") + model(x, "b")).sum().backward()  # every parameter: one call per width
    return skipped, stats["reduce_scatter"].calls - skipped[0], stats["widths_skipped"].calls


def test_widths_per_parameter_with_a_parameter_unused_in_a_step():
    for skipped, calls, still in run_distributed(_unused_parameter, 2):
        assert skipped == (1, 1) and calls == 3 and still == 1
