"""qsdp.ddp.register: compressed DDP on real gloo processes (CGX, Global-QSGD, 8-bit)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
import qsdp.comm as qc
from qsdp.testing import assert_same_on_all_ranks, count_dist_bytes, run_distributed

from ..models import batch as _batch
from ..models import classifier as _model
from ..models import train

STEPS = 25


def _train(
    rank: int,
    recipe: str | None,
    *,
    error_feedback: bool = False,
    bucket_mb=0.01,
    pipeline: bool = False,
):
    ddp = DDP(_model(), bucket_cap_mb=bucket_mb)
    hook = None
    if recipe:
        hook = qsdp.ddp.register(
            ddp,
            recipe,
            error_feedback=error_feedback,
            schedule=qsdp.Schedule(pipeline=pipeline),
        )
    losses = train(ddp, rank, STEPS)
    for p in ddp.parameters():
        assert_same_on_all_ranks(p.detach())  # replicas bit-identical after training
    return losses, hook, ddp


def _worker(rank: int, world: int) -> dict:
    exact, _, _ = _train(rank, None)
    out = {"exact": exact[-1]}
    for recipe, ef in (("cgx", False), ("cgx", True), ("global-qsgd", False), ("qsdp-g8", False)):
        losses, hook, ddp = _train(rank, recipe, error_feedback=ef)
        out[f"{recipe}{'+ef' if ef else ''}"] = losses[-1]
        # bytes of one more step, against *_wire_bytes of the buckets (after DDP's rebuild)
        before = hook.stats.total_bytes
        with count_dist_bytes() as sent:
            x, y = _batch(rank, 99)
            nn.functional.cross_entropy(ddp(x), y).backward()
        step_bytes = hook.stats.total_bytes - before
        assert step_bytes == sent.total_bytes, (recipe, step_bytes, sent.total_bytes)
        assert step_bytes == hook.wire_bytes_per_step(), (recipe, step_bytes)
        fp32 = 4 * sum(p.numel() for p in ddp.parameters())  # DDP's own all-reduce
        ratio = {"cgx": 0.2, "global-qsgd": 0.32, "qsdp-g8": 0.32}[recipe]
        assert 0 < step_bytes < ratio * fp32, (recipe, step_bytes, fp32)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_recipes_train_like_ddp(world):
    for out in run_distributed(_worker, world):
        for name in ("cgx", "cgx+ef", "global-qsgd", "qsdp-g8"):
            rel = (out[name] - out["exact"]) / out["exact"]
            assert abs(rel) < 0.03, f"{name}: final loss {out[name]:.4f} vs {out['exact']:.4f}"


def _feedback_checkpoint(rank: int, world: int, path: str) -> float:
    import torch.distributed.checkpoint as dcp

    ddp = DDP(_model(), bucket_cap_mb=0.01)
    hook = qsdp.ddp.register(ddp, "cgx", error_feedback=True)
    train(ddp, rank, 3)
    saved = {k: v.clone() for k, v in hook.state_dict().items() if "residual" in k}
    dcp.save({"qsdp": hook}, checkpoint_id=path)
    fresh = qsdp.ddp.register(DDP(_model(), bucket_cap_mb=0.01), "cgx", error_feedback=True)
    dcp.load({"qsdp": fresh}, checkpoint_id=path)
    loaded = {k: v for k, v in fresh.state_dict().items() if "residual" in k}
    assert saved.keys() == loaded.keys() and saved
    for k, v in saved.items():
        assert torch.equal(v, loaded[k]), k
    return sum(float(v.double().abs().sum()) for v in saved.values())


def _feedback_telescopes(rank: int, world: int) -> float:
    # gradients that do not depend on the weights: d(sum(W x))/dW = 1 x^T, known on each rank
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(96, 64, bias=False), bucket_cap_mb=0.01)
    hook = qsdp.ddp.register(ddp, "cgx", error_feedback=True)
    g = torch.Generator().manual_seed(rank)
    applied = torch.zeros(64, 96, dtype=torch.float64)
    exact = torch.zeros(64, 96, dtype=torch.float64)
    for _ in range(8):
        x = torch.randn(1, 96, generator=g)
        ddp.zero_grad()
        ddp(x).sum().backward()
        applied += ddp.module.weight.grad.double()
        mine = torch.ones(64, 1, dtype=torch.float64) * x.double()
        dist.all_reduce(mine)
        exact += mine / world
    owed = hook.state_dict()[f"residual.rank{rank}.weight"].double()
    dist.all_reduce(owed)
    far = float((applied - exact).abs().max())
    assert far > 0.05, far  # 4-bit codes lose something every step
    # error feedback re-sends every loss: what is still owed is exactly the last step's
    return float((applied + owed / world - exact).abs().max())


def test_error_feedback_applies_every_loss_once():
    # the residuals are the losses of the encodes that ran (both phases, their noise): the
    # sum of the applied gradients telescopes; an estimate by another encode left a random walk
    for gap in run_distributed(_feedback_telescopes, 3):
        assert gap < 1e-4, gap


def test_error_feedback_residuals_survive_a_checkpoint_on_every_rank(tmp_path):
    # each rank's residual is its own: a DCP checkpoint keeps all of them (it kept rank 0's
    # for every rank when they shared one key)
    sums = run_distributed(_feedback_checkpoint, 3, str(tmp_path / "ckpt"))
    assert len(set(sums)) == 3 and min(sums) > 0


def _several(rank: int, world: int) -> dict:
    # two DDP models in one process, each with its own hook; the user's own all-reduce exact
    a = DDP(_model(), bucket_cap_mb=0.01)
    b = DDP(_model(), bucket_cap_mb=0.01)
    ha = qsdp.ddp.register(a, "cgx")
    hb = qsdp.ddp.register(b, "global-qsgd")
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(a(x), y).backward()
    mine = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(mine)
    assert torch.equal(mine, torch.arange(5.0) * sum(r + 1 for r in range(world)))
    nn.functional.cross_entropy(b(x), y).backward()
    assert set(ha.stats.snapshot()) == {"two_phase_all_reduce"}
    assert set(hb.stats.snapshot()) == {"integer_all_reduce"}
    # no_sync: the first micro-batch accumulates locally, the second reduces both
    c = DDP(_model(), bucket_cap_mb=0.01)
    ref = DDP(_model(), bucket_cap_mb=0.01)
    hc = qsdp.ddp.register(c, "qsdp-g8")
    for model in (c, ref):
        with model.no_sync():
            nn.functional.cross_entropy(model(x), y).backward()
        x2, y2 = _batch(rank, 1)
        nn.functional.cross_entropy(model(x2), y2).backward()
    assert hc.stats["two_phase_all_reduce"].calls == len(hc._calls)  # one reduce per bucket
    g = torch.cat([p.grad.reshape(-1) for p in c.parameters()])
    g_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert float((g - g_ref).norm() / g_ref.norm()) < 0.02
    # "bf16": DDP's own all-reduce through the same hook, counted as wire_bytes_per_step says
    plain = DDP(_model(), bucket_cap_mb=0.01)
    hp = qsdp.ddp.register(plain, "bf16")
    nn.functional.cross_entropy(plain(x), y).backward()
    numel = sum(p.numel() for p in plain.parameters())
    assert hp.stats.total_bytes == hp.wire_bytes_per_step() == 4 * numel
    # state_dict round trip
    state = hc.state_dict()
    hc2 = qsdp.ddp.register(DDP(_model()), "qsdp-g8")
    hc2.load_state_dict(state)
    assert hc2._calls == hc._calls
    return {}


def _plain_is_ddps_own(rank: int, world: int) -> None:
    own, plain = DDP(_model(), bucket_cap_mb=0.01), DDP(_model(), bucket_cap_mb=0.01)
    hp = qsdp.ddp.register(plain, "bf16")
    numel = sum(p.numel() for p in plain.parameters())
    for model in (own, plain):
        with model.no_sync():  # accumulates locally: nothing sent, nothing counted
            nn.functional.cross_entropy(model(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
        assert hp.stats.total_bytes == 0
        x, y = _batch(rank, 1)
        nn.functional.cross_entropy(model(x), y).backward()
    # DDP's own all-reduce, the same bits, counted once per synchronised backward
    for a, b in zip(own.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert hp.stats.total_bytes == hp.wire_bytes_per_step() == 4 * numel
    assert hp.stats["all_reduce"].calls == 1


def test_uncompressed_is_ddps_own_all_reduce_counted():
    run_distributed(_plain_is_ddps_own, 3)


def test_several_models_no_sync_and_user_all_reduce():
    run_distributed(_several, 3)


def _nan(rank: int, world: int, mode: str, name: str = "cgx") -> tuple[str, float, bool, int]:
    """A NaN loss on the last rank at step 0 of two: the hook zeroes the buckets on the device
    when the backward ends, and the host reads the verdict when the next backward ends
    ([Note: the verdict read one backward later] in ``qsdp.runtime.nonfinite``)."""
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    state = qsdp.ddp.register(ddp, qsdp.recipe(name, nonfinite=mode))
    start = time.monotonic()
    verdict, finite = "ok", True
    for step in range(2):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if rank == world - 1 and step == 0:
            loss = loss * float("nan")
        try:
            loss.backward()  # step 0: no raise, the host has not read the flags yet
        except Exception as e:  # DDP re-raises the hook future's error
            verdict = f"step {step}: {e}"
            break
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters() if p.grad is not None])
        finite = finite and bool(torch.isfinite(grads).all())
        for p in ddp.parameters():
            p.grad = None
    zeroed = getattr(state, "zeroed", 0)
    return verdict, time.monotonic() - start, finite, zeroed


def test_nan_on_one_rank_same_outcome_everywhere():
    results = run_distributed(_nan, 3, "raise", pg_timeout_s=30)
    # raised from the next backward, on every rank, naming the bucket; the bad step's
    # gradients were zeroed on the device (finite) before any optimizer could apply them
    for v, _, finite, _ in results:
        assert v.startswith("step 1: ") and "the DDP bucket holding" in v and finite, v
        assert "non-finite gradient" in v
    assert len({v for v, _, _, _ in results}) == 1  # the same verdict on every rank
    assert max(t for _, t, _, _ in results) < 5
    zeroed = run_distributed(_nan, 2, "zero", pg_timeout_s=30)
    assert all(v == "ok" and finite and n >= 1 for v, _, finite, n in zeroed), zeroed
    # uncompressed: as DDP's own all-reduce, the NaN reaches every rank in the same sum
    plain = run_distributed(_nan, 3, "raise", "bf16", pg_timeout_s=30)
    assert all(v == "ok" and not finite for v, _, finite, _ in plain)


def _pipelined(rank: int, world: int) -> None:
    for recipe, ef in (("cgx", False), ("cgx", True), ("global-qsgd", False)):
        one, hook_one, ddp_one = _train(rank, recipe, error_feedback=ef)
        two, hook_two, ddp_two = _train(rank, recipe, error_feedback=ef, pipeline=True)
        assert hook_one.second_group is None and hook_two.second_group is not None
        assert dist.get_process_group_ranks(hook_two.second_group) == list(range(world))
        # [Note: pipelined buckets]: the same training, bit for bit, and the same bytes
        assert one == two, (recipe, ef, one[-3:], two[-3:])
        for p, q in zip(ddp_one.parameters(), ddp_two.parameters(), strict=True):
            assert torch.equal(p, q)
        assert hook_one.stats.total_bytes == hook_two.stats.total_bytes > 0
    with pytest.raises(ValueError, match=r"Schedule\(pipeline=True\) runs a compressed all-reduce"):
        qsdp.ddp.register(DDP(_model()), "bf16", schedule=qsdp.Schedule(pipeline=True))


def test_pipelined_buckets_train_the_same_bits():
    run_distributed(_pipelined, 3)


def test_register_refuses_bad_input():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        qsdp.ddp.register(nn.Linear(2, 2), "cgx")


def _refusals(rank: int, world: int) -> None:
    ddp = DDP(_model())
    with pytest.raises(ValueError, match="compresses weights"):
        qsdp.ddp.register(ddp, "qsdp-w8g8")
    with pytest.raises(ValueError, match="TwoLevelGrads, a reduce-scatter"):
        qsdp.ddp.register(ddp, "tlq-hs-only")
    with pytest.raises(ValueError, match="error_feedback=True needs quantized"):
        qsdp.ddp.register(ddp, "global-qsgd", error_feedback=True)
    with pytest.raises(ValueError, match="DDP gathers no weights: drop gather_ahead"):
        qsdp.ddp.register(ddp, "cgx", schedule=qsdp.Schedule(staleness=1, gather_ahead=True))
    assert isinstance(qsdp.recipe("cgx").grads.plan(), qc.QuantizedReduce)


def test_register_refuses_bad_configs():
    run_distributed(_refusals, 1)
