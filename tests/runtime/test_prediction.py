"""Weight prediction (staleness 1's remedy): the last optimizer update, added around a step's
forward and backward, on plain parameters and on FSDP2's shards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import qsdp
from qsdp.runtime import WeightPrediction
from qsdp.runtime.adam_step import adam_next
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import batch, classifier


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_the_update_is_the_last_step_and_ahead_adds_it():
    model = classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    predict = WeightPrediction(opt)
    with predict.ahead():  # before the first step there is nothing to add
        assert all(
            torch.equal(a, b)
            for a, b in zip(_snapshot(model), _snapshot(classifier()), strict=True)
        )
    for step in range(3):
        before = _snapshot(model)
        with predict.ahead():
            _loss(model, 0, step).backward()
        after_backward = _snapshot(model)
        opt.step()
        opt.zero_grad()
        after = _snapshot(model)
        # the buffer is exactly the step's update
        for u, a, b in zip(predict.update, after, after_backward, strict=True):
            assert torch.equal(u, a - b)
        if step:  # ahead() undid its shift: the parameters are the step's, up to one rounding
            for a, b in zip(after_backward, before, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    x = _snapshot(model)
    with predict.ahead():
        inside = _snapshot(model)
        with pytest.raises(RuntimeError, match="not reentrant"):
            with predict.ahead():
                pass
        with pytest.raises(RuntimeError, match=r"optimizer.step\(\) inside"):
            opt.step()
    for got, xi, u in zip(inside, x, predict.update, strict=True):
        assert torch.equal(got, xi + u) and u.abs().max() > 0
    x = _snapshot(model)
    with predict.ahead(enabled=False):
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(model), x, strict=True))


def test_the_gradient_is_taken_at_the_predicted_point():
    model, twin = classifier(), classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    predict = WeightPrediction(opt)
    _loss(model, 0, 0).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():  # the twin sits where the prediction points: x + (x - x_before)
        for t, p, u in zip(twin.parameters(), model.parameters(), predict.update, strict=True):
            t.copy_(p + u)
    with predict.ahead():
        _loss(model, 0, 1).backward()
    _loss(twin, 0, 1).backward()
    for p, t in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, t.grad)


def test_state_round_trips_and_refuses_another_model():
    model = classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    predict = WeightPrediction(opt)
    assert int(predict.state_dict()["has_update"]) == 0
    _loss(model, 0, 0).backward()
    opt.step()
    state = predict.state_dict()
    fresh = WeightPrediction(torch.optim.AdamW(classifier().parameters(), lr=1e-2))
    fresh.load_state_dict(state)
    for a, b in zip(fresh.update, predict.update, strict=True):
        assert torch.equal(a, b)
    other = WeightPrediction(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0))
    with pytest.raises(ValueError, match="has 7 parameters, the optimizer 2"):
        other.load_state_dict(state)
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer, got list"):
        WeightPrediction(list(model.parameters()))
    predict.remove()  # the optimizer's steps are no longer tracked
    kept = [u.clone() for u in predict.update]
    _loss(model, 0, 1).backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(kept, predict.update, strict=True))


def _stale_fsdp(world: int, recipe: str):
    """The classifier under FSDP2 at staleness 1 over ``world`` ranks: model, comm state, AdamW."""
    mesh = init_device_mesh("cpu", (world,))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    qsdp.compress_fsdp(model, recipe, schedule=qsdp.Schedule(staleness=1, start=0, predict="none"))
    return model, qsdp.fsdp.comm_state(model), torch.optim.AdamW(model.parameters(), lr=1e-2)


def _sharded(rank: int, world: int) -> None:
    model, state, opt = _stale_fsdp(world, "bf16")
    predict = WeightPrediction(opt)
    seen = []
    for step in range(4):
        full = [p.full_tensor() for p in model.parameters()]
        in_flight = state.in_flight
        with predict.ahead(enabled=in_flight):
            # FSDP2 computes on the shifted shards: an unsharded twin at x + u has its loss
            shifted = full
            if in_flight and predict.update is not None:
                ups = [
                    torch.distributed.tensor.DTensor.from_local(
                        u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    ).full_tensor()
                    for u, p in zip(predict.update, model.parameters(), strict=True)
                ]
                shifted = [f + u for f, u in zip(full, ups, strict=True)]
            twin = classifier()
            with torch.no_grad():
                for t, s in zip(twin.parameters(), shifted, strict=True):
                    t.copy_(s)
            loss = _loss(model, rank, step)
            torch.testing.assert_close(loss, _loss(twin, rank, step))
            loss.backward()
            seen.append(
                (in_flight, any(not torch.equal(a, b) for a, b in zip(shifted, full, strict=True)))
            )
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
    # step 0: nothing in flight; step 1: in flight, but no update yet; steps 2, 3: ahead
    assert seen == [(False, False), (True, False), (True, True), (True, True)], seen
    state.drain()
    assert not state.in_flight
    opt.step()
    dist.barrier()


def test_fsdp2_computes_at_the_predicted_shards():
    run_distributed(_sharded, 3)


class _Source:
    """A stand-in for FSDP2's comm state: fixed local gradient estimates."""

    def __init__(self, estimates: dict) -> None:
        self.estimates, self.kept = estimates, False

    def keep_local_gradients(self) -> None:
        self.kept = True

    def local_gradients(self, *, take: bool = False) -> dict:
        return self.estimates  # (fixed: taken or not, the same each time)

    def estimate_square_norm(self, estimates: dict) -> torch.Tensor:
        return torch.stack([g.float().square().sum() for g in estimates.values()]).sum()


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``item()``, ``float()``: on a GPU each
    waits for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_clipped_prediction_never_reads_the_device():
    """[Note: a clipped prediction never reads the device]: clipping the estimate by its norm
    adds no host read to a predicted step (the coefficient stays a tensor), and still clips."""
    torch.manual_seed(0)
    model = classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, 0, 0).backward()
    opt.step()
    opt.zero_grad()
    g = torch.Generator().manual_seed(5)
    estimates = {p: 100 * torch.randn(p.shape, generator=g) for p in model.parameters()}
    predict = WeightPrediction(opt, local=_Source(estimates))
    moved = {}
    for clip in (None, 1.0):
        counter = _HostReads()
        with counter, predict.ahead(clip=clip):
            moved[clip] = [p.detach().clone() for p in model.parameters()]
        moved[clip, "reads"] = counter.reads
    assert moved[1.0, "reads"] == moved[None, "reads"]
    assert not all(torch.equal(a, b) for a, b in zip(moved[None], moved[1.0], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_a_clipped_prediction_never_makes_the_host_wait_on_cuda(fused):
    """The same on CUDA under the sync detector: the clipped prediction's kernel reads the
    coefficient on the device, and equals the prediction clipped by the host's number."""
    from ..host_syncs import first_sync

    dev = torch.device("cuda", torch.cuda.current_device())
    model = classifier().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
    opt.step()
    g = torch.Generator().manual_seed(5)
    estimates = {p: 100 * torch.randn(p.shape, generator=g).to(dev) for p in model.parameters()}
    source = _Source(estimates)
    predict = WeightPrediction(opt, local=source)
    moved = []

    def ahead() -> None:
        with predict.ahead(clip=1.0):
            moved.extend(p.detach().clone() for p in model.parameters())

    assert first_sync(ahead) == "none"
    # the step clipped by the host's number (read here, after the check)
    coef = min(1.0, 1.0 / (float(source.estimate_square_norm(estimates).sqrt()) + 1e-6))
    saved = adam_next(opt, estimates, coef)  # (moved in place, restored below)
    want = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        torch._foreach_copy_([x for x, _ in saved], [c for _, c in saved])
    for a, b in zip(moved, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _adam_decoupled(params, **kw):
    return torch.optim.Adam(params, decoupled_weight_decay=True, **kw)


@pytest.mark.parametrize("clipped", [False, True])
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam, _adam_decoupled])
def test_local_prediction_is_the_optimizers_next_step_with_the_estimate(kind, clipped):
    import copy

    model = classifier()
    opt = kind(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        _loss(model, 0, step).backward()
        opt.step()
        opt.zero_grad()
    twin = copy.deepcopy(model)
    twin_opt = kind(twin.parameters(), lr=1e-2, weight_decay=0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (its tensors are shared)
    g = torch.Generator().manual_seed(5)
    estimates = {p: torch.randn(p.shape, generator=g) for p in model.parameters()}
    source = _Source(estimates)
    predict = WeightPrediction(opt, local=source)
    assert source.kept and predict.update is None
    norm = torch.linalg.vector_norm(torch.cat([e.reshape(-1) for e in estimates.values()]))
    for t, e in zip(twin.parameters(), estimates.values(), strict=True):
        t.grad = e.clone()
    clip = float(norm) / 2 if clipped else None
    if clipped:  # as the trainer clips the gradient it applies
        torch.nn.utils.clip_grad_norm_(twin.parameters(), clip)
    twin_opt.step()  # torch's own step with the estimate
    before = _snapshot(model)
    with predict.ahead(clip=clip):
        for p, t in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)
    for a, b in zip(_snapshot(model), before, strict=True):  # restored bit for bit
        assert torch.equal(a, b)
    with predict.ahead(enabled=False):
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(model), before, strict=True))
    with predict.ahead(), pytest.raises(RuntimeError, match=r"optimizer.step\(\) inside"):
        opt.step()  # would step from the predicted parameters, then be overwritten
    assert predict.state_dict() == {"local": torch.tensor([1])}
    with pytest.raises(ValueError, match="different sources"):
        predict.load_state_dict({"has_update": torch.tensor([0])})


def test_local_prediction_refuses_what_it_cannot_compute():
    model = classifier()
    with pytest.raises(TypeError, match="knows Adam and AdamW, not SGD"):
        WeightPrediction(torch.optim.SGD(model.parameters(), lr=0.1), local=_Source({}))
    with pytest.raises(ValueError, match="amsgrad=True is not it"):
        WeightPrediction(torch.optim.AdamW(model.parameters(), amsgrad=True), local=_Source({}))
    # a hyperparameter on a device (here the meta device: CI has no GPU) would make the host wait
    # at every gather; a CPU tensor is read without waiting
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device="meta")
    with pytest.raises(ValueError, match="lr is a tensor on meta"):
        WeightPrediction(opt, local=_Source({}))
    on_cpu = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    WeightPrediction(on_cpu, local=_Source({}))


def _local_estimates(rank: int, world: int) -> None:
    # full-precision weights (the twin computes on the same ones), integer-coded gradients
    model, state, opt = _stale_fsdp(world, "global-qsgd")
    predict = WeightPrediction(opt, local=state)
    assert state.local_gradients() == {}  # nothing in flight yet
    twin = classifier()  # this rank's own gradient, unsharded
    _loss(twin, rank, 0).backward()
    _loss(model, rank, 0).backward()
    estimates = state.local_gradients()
    assert len(estimates) == 7
    for p, t in zip(model.parameters(), twin.parameters(), strict=True):
        rows = p.to_local().shape[0]
        start = rank * -(-p.shape[0] // world)  # FSDP2 shards dim 0 in chunks of ceil(n / world)
        torch.testing.assert_close(estimates[p], t.grad[start : start + rows])
    opt.step()
    opt.zero_grad()
    with predict.ahead(enabled=state.in_flight):  # on the sharded DTensors: they move
        moved = [p.full_tensor() for p in model.parameters()]
    after = [p.full_tensor() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(moved, after, strict=True))
    state.drain()
    assert state.local_gradients() == {}
    # the world's shards make one estimate: its squared norm is the sum over every rank
    _loss(model, rank, 1).backward()  # (in flight again)
    square = torch.stack([g.square().sum() for g in state.local_gradients().values()]).sum()
    total = square.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(state.estimate_square_norm(state.local_gradients()), total)


def test_fsdp2_keeps_each_ranks_own_gradient_of_its_shard():
    run_distributed(_local_estimates, 3)


def _kept_estimates(state) -> list:
    """Weak references to the buffers the state keeps its estimates in."""
    held = state._installed.stale._local.values()
    return list({id(e.buffer): weakref.ref(e.buffer) for e, _ in held}.values())


def _estimates_handed_over(rank: int, world: int) -> list[int]:
    """[Note: estimates handed over]: the prediction reads the estimates once and the state
    keeps them no longer, so they are not held through the forward (the step's peak); the
    next backward keeps new ones. By hand and as the schedule ships it."""
    alive = []
    model, state, opt = _stale_fsdp(world, "global-qsgd")
    predict = WeightPrediction(opt, local=state)
    _loss(model, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    kept = _kept_estimates(state)
    assert kept and state.in_flight
    with predict.ahead(enabled=state.in_flight):
        gc.collect()
        alive.append(sum(r() is not None for r in kept))
        assert state.local_gradients() == {}
        _loss(model, rank, 1).backward()
        assert len(state.local_gradients()) == 7  # the new backward's
    state.drain()

    mesh = init_device_mesh("cpu", (world,))
    model = classifier()
    fully_shard(model, mesh=mesh)
    qsdp.compress_fsdp(model, "global-qsgd", schedule=qsdp.Schedule(staleness=1, start=0))
    state = qsdp.fsdp.comm_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        kept = _kept_estimates(state)
        loss = _loss(model, rank, step)  # step 2's forward predicts (Adam's state exists)
        gc.collect()
        if step == 2:
            assert kept and state._installed.stale._local == {}
            alive.append(sum(r() is not None for r in kept))
        loss.backward()
        opt.step()
        opt.zero_grad()
    state.drain()
    return alive


def test_the_prediction_takes_the_estimates_so_the_forward_holds_none():
    for alive in run_distributed(_estimates_handed_over, 3):
        assert alive == [0, 0], alive


def _every_ranks_gradient(rank: int, world: int) -> list[list[torch.Tensor]]:
    """Per parameter, every rank's own gradient of step 0 (an unsharded twin's, gathered)."""
    twin = classifier()
    _loss(twin, rank, 0).backward()
    grads = []
    for t in twin.parameters():
        every = [torch.empty_like(t.grad) for _ in range(world)]
        dist.all_gather(every, t.grad)
        grads.append(every)
    return grads


def _first_stale_step(model: nn.Module, rank: int, world: int) -> tuple:
    """(comm state, AdamW, WeightPrediction from the local estimates, every rank's own gradient,
    the estimates) after step 0's backward of a model compressed at staleness 1."""
    state = qsdp.fsdp.comm_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    predict = WeightPrediction(opt, local=state)
    grads = _every_ranks_gradient(rank, world)
    _loss(model, rank, 0).backward()
    return state, opt, predict, grads, state.local_gradients()


def _two_level_estimates(rank: int, world: int) -> dict:
    """FSDP2 over 2 nodes x 2 with SDP4Bit's two levels (gloo): each rank's estimate is its
    shard's gradient averaged over its node (through the peers' 8-bit intra-node codes; the
    1-D parameters, sent raw, its own), handed over by the reduce-scatter before the slow
    inter-node level, which alone is late."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("inter", "intra"))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i])
    fully_shard(model)
    qsdp.compress_fsdp(
        model, "sdp4bit", mesh=mesh, schedule=qsdp.Schedule(staleness=1, start=0, predict="none")
    )
    state, opt, predict, grads, estimates = _first_stale_step(model, rank, world)
    node, per_node = rank // (world // 2), world // 2
    errors = {}
    for (name, p), every in zip(model.named_parameters(), grads, strict=True):
        rows = p.to_local().shape[0]
        start = rank * -(-p.shape[0] // world)
        own = every[rank][start : start + rows]
        if p.ndim == 1:  # raw beside the codes: no node level, the own gradient
            torch.testing.assert_close(estimates[p], own, rtol=0, atol=0)
            continue
        mean = torch.stack(every[node * per_node : (node + 1) * per_node]).mean(0)
        mean = mean[start : start + rows]
        errors[name] = float((estimates[p] - mean).norm() / mean.norm())
        assert errors[name] < 0.02, (name, errors[name])  # 8-bit codes of the node's peer
        assert (estimates[p] - own).norm() > 10 * (estimates[p] - mean).norm(), name
    # the world's shards make one estimate: its squared norm sums over every rank
    square = torch.stack([g.square().sum() for g in estimates.values()]).sum()
    total = square.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(state.estimate_square_norm(estimates), total)
    opt.step()
    opt.zero_grad()
    before = [p.full_tensor() for p in model.parameters()]
    with predict.ahead(enabled=state.in_flight, clip=1.0):  # each rank moves its own shard
        moved = [p.full_tensor() for p in model.parameters()]
    assert all(not torch.equal(x, y) for x, y in zip(before, moved, strict=True))
    state.drain()
    return errors


def test_two_levels_keep_each_shards_node_average():
    out = run_distributed(_two_level_estimates, 4)
    assert all(0 < e for errors in out for e in errors.values())  # codes, not the exact mean


def _hsdp_estimates(rank: int, world: int) -> dict:
    """Compressed HSDP on 2 nodes x 2 (gloo): only the replicate all-reduce is delayed, and each
    rank's estimate is its node's average gradient of its shard."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    stale = qsdp.Schedule(staleness=1, start=0, predict="none")
    qsdp.compress_fsdp(model, "cgx", replicate=mesh["replicate"], schedule=stale)
    state, opt, predict, grads, estimates = _first_stale_step(model, rank, world)
    node, shard, per_node = rank // (world // 2), rank % (world // 2), world // 2
    for p, every in zip(model.parameters(), grads, strict=True):
        mean = torch.stack(every[node * per_node : (node + 1) * per_node]).mean(0)
        rows = p.to_local().shape[0]
        start = shard * -(-p.shape[0] // per_node)
        torch.testing.assert_close(estimates[p], mean[start : start + rows])
    # one estimate's norm is the node's: the sum over its shards only
    square = torch.stack([g.square().sum() for g in estimates.values()]).sum()
    node_sum = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(node_sum, square)
    expect = sum(node_sum[node * per_node : (node + 1) * per_node])
    torch.testing.assert_close(state.estimate_square_norm(estimates), expect)
    saved = state.state_dict()  # each replica's own estimate under its own key
    keys = sorted(k for k in saved if k.startswith("local."))
    names = sorted(n for n, p in model.named_parameters())
    assert keys == [f"local.replica{node}.{n}" for n in names], keys
    opt.step()
    opt.zero_grad()
    with predict.ahead(enabled=state.in_flight, clip=1.0):  # each node shifts by its own
        moved = [p.full_tensor() for p in model.parameters()]
    state.drain()
    return {"node": node, "moved": moved}


def test_hsdp_keeps_each_nodes_average_and_nodes_predict_apart():
    out = run_distributed(_hsdp_estimates, 4)
    # the two ranks of a node compute on the same predicted weights; the nodes, whose
    # estimates differ, on different ones
    for a, b in ((0, 1), (2, 3)):
        for x, y in zip(out[a]["moved"], out[b]["moved"], strict=True):
            assert torch.equal(x, y)
    assert any(not torch.equal(x, y) for x, y in zip(out[0]["moved"], out[2]["moved"], strict=True))


def _ddp_estimates(rank: int, world: int) -> list[torch.Tensor]:
    """DDP at staleness 1: each rank's estimate is its own whole gradient; the replicas
    predict apart and are identical again after the backward."""
    ddp = DDP(classifier(), bucket_cap_mb=0.001)  # several buckets
    hook = qsdp.ddp.register(
        ddp, "cgx", schedule=qsdp.Schedule(staleness=1, start=0, predict="none")
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    predict = WeightPrediction(opt, local=hook)
    assert hook.local_gradients() == {}
    twin = classifier()
    _loss(twin, rank, 0).backward()
    _loss(ddp, rank, 0).backward()  # applies nothing; its reduction is in flight
    estimates = hook.local_gradients()
    for p, t in zip(ddp.module.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(estimates[p], t.grad)
    norm = hook.estimate_square_norm(estimates)  # this rank's own: no collective
    torch.testing.assert_close(norm, sum(t.grad.square().sum() for t in twin.parameters()))
    opt.zero_grad()
    for step in (1, 2):  # step 1 has no optimizer state to predict from yet; step 2 has
        with predict.ahead(enabled=hook.in_flight, clip=1.0):
            moved = [p.detach().clone() for p in ddp.parameters()]
            _loss(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad()
        for p in ddp.parameters():
            assert_same_on_all_ranks(p.detach())  # restored before the step: replicas agree
    hook.drain()
    assert hook.local_gradients() == {}
    with pytest.raises(ValueError, match="for staleness=1"):
        qsdp.ddp.register(DDP(classifier()), qsdp.recipe("cgx")).keep_local_gradients()
    return moved


def test_ddp_predicts_from_each_ranks_own_gradient():
    moved = run_distributed(_ddp_estimates, 3)
    # each rank moved by its own estimate: the replicas computed at different points
    assert any(not torch.equal(a, b) for a, b in zip(moved[0], moved[1], strict=True))


# --- Schedule(predict="local"): the loop by hand, on hooks ------------------------------------
def _train(
    rank: int, world: int, kind: str, how: str, steps: int = 6, micro: int = 1
) -> list[torch.Tensor]:
    """``steps`` steps of the README loop at staleness 1 from the start, its gradient taken
    ahead by hand (``how="hand"``), by the schedule as shipped (``"schedule"``, the default
    ``predict``) or not at all (``"none"``); the parameters after the drained last step.
    ``micro``: micro-batches a step (gradient accumulation, FSDP2; the reduction runs on the
    last one's backward)."""
    if how == "schedule":  # the default: staleness 1 as shipped predicts
        schedule = qsdp.Schedule(staleness=1, start=0)
    else:
        schedule = qsdp.Schedule(staleness=1, start=0, predict="none")
    model, run, state = _staleness_model(kind, schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    by_hand = WeightPrediction(opt, local=state) if how == "hand" else None
    for step in range(steps):
        ahead = by_hand.ahead(enabled=state.in_flight) if by_hand else _nothing()
        with ahead:
            for k in range(micro):
                if micro > 1:
                    model.set_requires_gradient_sync(k == micro - 1)
                _loss(run, rank, step * micro + k).backward()
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
    state.drain()
    opt.step()
    return [_full(p) for p in model.parameters()]


def _staleness_model(kind: str, schedule: qsdp.Schedule) -> tuple:
    """(model, what runs it, its comm state): the classifier under FSDP2 (``qsdp-w8g8``;
    ``fsdp2-diffs``: ``sdp4bit``'s weight differences) or DDP (``cgx``) with ``schedule``."""
    model = classifier()
    if kind.startswith("fsdp2"):
        # fsdp2-bf16: bf16 compute, the gathers' inputs cast from the fp32 shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = {"mp_policy": mp} if kind == "fsdp2-bf16" else {}
        for i in (2, 5):
            fully_shard(model[i], **kw)
        fully_shard(model, **kw)
        recipe = "sdp4bit" if kind in ("fsdp2-diffs", "fsdp2-2level") else "qsdp-w8g8"
        mesh = None
        if kind == "fsdp2-2level":  # SDP4Bit's two levels, 2 nodes x 2: node-averaged estimates
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
        qsdp.compress_fsdp(model, recipe, mesh=mesh, schedule=schedule)
        return model, model, qsdp.fsdp.comm_state(model)
    run = DDP(model)
    recipe = "bf16" if kind == "ddp-bf16" else "cgx"  # (bf16: the same sums however bucketed)
    return model, run, qsdp.ddp.register(run, recipe, schedule=schedule)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> bool:
        return False


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _three_ways(rank: int, world: int, kind: str, micro: int = 1) -> dict:
    runs = {
        how: _train(rank, world, kind, how, micro=micro) for how in ("hand", "schedule", "none")
    }
    same = all(torch.equal(a, b) for a, b in zip(runs["hand"], runs["schedule"], strict=True))
    moved = any(not torch.equal(a, b) for a, b in zip(runs["hand"], runs["none"], strict=True))
    assert_same_on_all_ranks(runs["schedule"][0])
    return {"same": same, "moved": moved}


@pytest.mark.parametrize(
    "kind, world",
    [("fsdp2", 3), ("fsdp2-bf16", 3), ("fsdp2-diffs", 3), ("fsdp2-2level", 4), ("ddp", 3)],
)
def test_the_schedule_predicts_as_the_loop_by_hand(kind, world):
    """[Note: prediction in the schedule]: the same parameters, bit for bit, as the README's
    loop with its WeightPrediction, and not those of the delay as it is. Under FSDP2 the
    schedule predicts in the gathers, the loop by hand moves the parameters ([Note: the
    prediction in the gathers]): the same gathered bits."""
    for got in run_distributed(_three_ways, world, kind):
        assert got == {"same": True, "moved": True}, got


def _accumulated(rank: int, world: int) -> dict:
    hows = ("hand", "schedule", "none")
    runs = {how: _train(rank, world, "fsdp2-diffs", how, micro=2) for how in hows}

    def gap(a: str, b: str) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(runs[a], runs[b], strict=True))

    return {"schedule": gap("hand", "schedule"), "unpredicted": gap("hand", "none")}


def test_gradient_accumulation_predicts_in_the_weight_difference_gathers():
    """Two micro-batches a step with ``sdp4bit``: the schedule's later gathers of a step are
    served from what its first sent (its estimates dropped; a gather that needed them would
    raise), where the loop by hand sends the weights' difference again (a second quantized
    residual): not bit for bit, but nearer the loop by hand than the unpredicted delay is
    (0.0028 against 0.0060 on weights up to 4.1, torch 2.13, CPU)."""
    for got in run_distributed(_accumulated, 3):
        assert 0 < got["schedule"] < got["unpredicted"], got


def _sgd_refused(rank: int, world: int) -> str:
    model = classifier()
    fully_shard(model)
    schedule = qsdp.Schedule(staleness=1, start=0, predict="local")
    qsdp.compress_fsdp(model, "qsdp-w8g8", schedule=schedule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, rank, 0).backward()
    try:
        opt.step()
    except TypeError as e:
        return str(e)
    return "no error"


def test_the_schedule_refuses_an_optimizer_it_cannot_predict_on_every_rank():
    for message in run_distributed(_sgd_refused, 2):
        assert "Schedule(predict='local') predicts SGD's next step" in message
        assert "predict='none'" in message


def _twice(rank: int, world: int, kind: str, order: str) -> str:
    """A hand-made WeightPrediction beside the schedule's default prediction, built before the
    first step (``order="before"``: the schedule refuses at that step) or after it."""
    schedule = qsdp.Schedule(staleness=1, start=0)  # predict="local", as shipped
    model, run, state = _staleness_model(kind, schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        if order == "before":
            WeightPrediction(opt)
        _loss(run, rank, 0).backward()
        opt.step()
        if order == "after":
            WeightPrediction(opt, local=state)
    except ValueError as e:
        return str(e)
    finally:
        state.drain()
    return "no error"


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_two_predictions_of_one_parameter_are_refused_on_every_rank(kind, order):
    """[Note: one prediction per parameter]: the schedule's prediction and a hand-made one
    would move the parameters twice; refused at the first step or at once, on every rank."""
    for message in run_distributed(_twice, 3, kind, order):
        assert "already moved by another WeightPrediction" in message, message
        assert "predict='none'" in message
        if order == "before":
            assert message.startswith("Schedule(predict='local') predicts AdamW"), message


def _two_models_one_optimizer(rank: int, world: int) -> list[int]:
    """Two DDP models at staleness 1 as shipped, one optimizer over both: each schedule's
    prediction claims its own model's parameters only, so both predict."""
    runs, hooks = [], []
    for _ in range(2):
        run = DDP(classifier())
        hooks.append(qsdp.ddp.register(run, "cgx", schedule=qsdp.Schedule(staleness=1, start=0)))
        runs.append(run)
    opt = torch.optim.AdamW([p for r in runs for p in r.parameters()], lr=3e-3)
    for step in range(3):
        sum(_loss(r, rank, step) for r in runs).backward()
        opt.step()
        opt.zero_grad()
    for hook in hooks:
        hook.drain()
    return [len(hook.predict.predictions) for hook in hooks]


def test_two_models_sharing_an_optimizer_each_predict_their_own():
    assert run_distributed(_two_models_one_optimizer, 2) == [[1, 1]] * 2


def test_a_removed_prediction_frees_its_parameters():
    import gc

    model = classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = WeightPrediction(opt)
    with pytest.raises(ValueError, match="already moved by another WeightPrediction"):
        WeightPrediction(torch.optim.SGD(list(model.parameters())[:1], lr=0.1))  # one shared
    first.remove()
    WeightPrediction(opt)  # free again; its hooks keep it alive with the optimizer
    with pytest.raises(ValueError, match="already moved by another WeightPrediction"):
        WeightPrediction(opt)
    del opt, first
    gc.collect()  # the optimizer gone, its prediction with it: the parameters are free
    WeightPrediction(torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_schedule_checks_its_prediction_settings():
    with pytest.raises(ValueError, match="must be 'local'"):
        qsdp.Schedule(staleness=1, predict="last")
    with pytest.raises(ValueError, match="with staleness=0 nothing is delayed"):
        qsdp.Schedule(predict="local")
    with pytest.raises(ValueError, match="positive number"):
        qsdp.Schedule(staleness=1, predict="local", predict_clip=0)
    with pytest.raises(ValueError, match="there is none"):
        qsdp.Schedule(staleness=1, predict="none", predict_clip=1.0)
    with pytest.raises(ValueError, match="there is none"):
        qsdp.Schedule(predict_clip=1.0)  # (synchronous)
    assert qsdp.Schedule(staleness=1).prediction == "local"  # the default, as shipped
    assert qsdp.Schedule().prediction == "none"
    assert qsdp.Schedule(staleness=1, predict="none").prediction == "none"


def _hooks_after_the_model_is_gone(rank: int, world: int) -> tuple[int, int, int, int]:
    import gc

    from torch.optim import optimizer as optim_module

    from qsdp.runtime import prediction

    hooks = optim_module._global_optimizer_pre_hooks
    before = len(hooks)
    model = classifier()
    fully_shard(model)
    qsdp.compress_fsdp(model, "qsdp-w8g8", schedule=qsdp.Schedule(staleness=1, start=0))
    installed = len(hooks)
    del model
    gc.collect()
    other = nn.Linear(2, 2)
    opt = torch.optim.AdamW(other.parameters())
    other(torch.ones(1, 2)).sum().backward()
    opt.step()  # the first step after: nothing of the dead model's prediction is left
    return before, installed, len(hooks), len(prediction._live)


def test_the_schedules_global_hook_leaves_with_its_model():
    """One global optimizer hook for the process ([Note: one global optimizer hook]); the dead
    model's prediction is no longer called."""
    for before, installed, after, live in run_distributed(_hooks_after_the_model_is_gone, 2):
        assert installed <= before + 1 and after == installed and live == 0


def _models_one_after_another(rank: int, world: int) -> list[float]:
    """A staleness-1 model built, trained and dropped after another (a benchmark's rounds):
    every optimizer step of the later ones runs, and each model still predicts. (Each model
    used to leave a global optimizer hook that took itself off inside ``Optimizer.step``'s
    loop over them: "OrderedDict mutated during iteration" from the third model on.)"""
    import gc

    from qsdp.runtime import prediction

    ahead = []
    for _ in range(3):
        model = classifier()
        fully_shard(model)
        qsdp.compress_fsdp(model, "qsdp-w8g8", schedule=qsdp.Schedule(staleness=1, start=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            _loss(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
        auto = [a for a in prediction._live if a._module() is model]
        ahead.append(float(len(auto) == 1 and len(auto[0].predictions) == 1))
        del model, opt, auto  # (the next model's steps run with this one's prediction dead)
        gc.collect()
    return ahead


def test_staleness_1_models_one_after_another():
    for ahead in run_distributed(_models_one_after_another, 2):
        assert ahead == [1.0, 1.0, 1.0]


def _shipped_after(rank: int, recipe: str, *, steps: int, inner: tuple[int, ...]) -> tuple:
    """(model, comm state, AdamW): the classifier under FSDP2 (``inner``: its layers sharded
    as groups of their own) with ``recipe`` at staleness 1 as shipped, after ``steps`` steps."""
    model = classifier()
    for i in inner:
        fully_shard(model[i])
    fully_shard(model)
    qsdp.compress_fsdp(model, recipe, schedule=qsdp.Schedule(staleness=1, start=0))
    state = qsdp.fsdp.comm_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        _loss(model, rank, step).backward()
        if not state.applied_nothing:
            opt.step()
        opt.zero_grad()
    return model, state, opt


def _evaluation_is_not_predicted(rank: int, world: int) -> dict:
    from qsdp.runtime import prediction

    model, state, opt = _shipped_after(rank, "qsdp-w8g8", steps=3, inner=())
    assert state.in_flight
    (auto,) = [a for a in prediction._live if a._module() is model]
    seen = []  # (predicting, the weights the first layer computed with)
    model[0].register_forward_hook(lambda m, *_: seen.append((auto.ahead, m.weight.detach() + 0)))
    # each rank's own shards (a full_tensor() after the evaluation's forward, which has no
    # backward, crashed gloo in the test process, predicting or not: noted for issue 32)
    params = list(model.parameters())
    before = [p.to_local().detach().clone() for p in params]
    model.eval()
    _loss(model, rank, 9)  # an evaluation with grad enabled: the weights as they are
    model.train()
    # training: at the predicted point until the step (FSDP2 kept the root gathered after the
    # evaluation, which had no backward: the prediction reshards it first)
    _loss(model, rank, 10).backward()
    # the gathers predict: the parameters themselves never move ([Note: the prediction in
    # the gathers])
    unmoved = all(torch.equal(a, p.to_local()) for a, p in zip(before, params, strict=True))
    opt.step()
    (eval_ahead, w_eval), (train_ahead, w_train) = seen
    return {
        "eval_predicted": eval_ahead,
        "train_predicted": train_ahead and not torch.equal(w_eval, w_train),
        "unmoved": unmoved,
    }


def test_an_evaluation_forward_is_never_predicted():
    for got in run_distributed(_evaluation_is_not_predicted, 2):
        assert got == {"eval_predicted": False, "train_predicted": True, "unmoved": True}, got


def _predicted_in_the_gathers(rank: int, world: int) -> dict:
    """[Note: the prediction in the gathers] with weight differences: the parameters never
    move, every group's estimates are dropped once its gather sent the predicted weights (none
    is held through the forward), and a parameter written in place before the backward's
    re-gather, which would need them again, raises."""
    model, state, opt = _shipped_after(rank, "sdp4bit", steps=2, inner=(2, 5))
    gathers = state._installed.predict._gathers
    before = [p.to_local().detach().clone() for p in model.parameters()]
    loss = _loss(model, rank, 2)  # predicted (Adam's state exists, a reduction in flight)
    out = {
        "armed": gathers.armed,
        "held_after_forward": len(gathers._armed),
        "kept_by_the_state": len(state._installed.stale._local),
    }
    loss.backward()  # (the root's parameters are its shards again after it)
    out["unmoved"] = all(
        torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=True)
    )
    opt.step()
    opt.zero_grad()
    out["disarmed"] = not gathers.armed
    loss = _loss(model, rank, 3)
    with torch.no_grad():
        next(model[2].parameters()).mul_(1.0)  # written in place between forward and step
    try:
        loss.backward()
        out["error"] = "none"
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_weight_difference_gathers_predict_and_drop_the_estimates():
    for got in run_distributed(_predicted_in_the_gathers, 3):
        error = got.pop("error")
        assert got == {
            "armed": True,
            "held_after_forward": 0,
            "kept_by_the_state": 0,
            "unmoved": True,
            "disarmed": True,
        }, got
        assert "gathered again in a step after its predicted weights were sent" in error, error


def _resumed(rank: int, world: int, kind: str, attach: bool) -> object:
    """[Note: a resumed prediction]: the README's loop at staleness 1 as shipped, 6 steps
    straight, against 3 steps, a checkpoint with the reduction in flight, and 3 more steps of a
    new model, optimizer and state loaded from it (``attach``: ``state.predict_with(opt)``
    after loading). True when they end on the same parameters; the error's text if it
    raised."""
    schedule = qsdp.Schedule(staleness=1, start=0)

    def steps(model, run, state, opt, which) -> None:
        for step in which:
            _loss(run, rank, step).backward()
            if not state.applied_nothing:
                opt.step()
            opt.zero_grad()

    def built() -> tuple:
        model, run, state = _staleness_model(kind, schedule)
        return model, run, state, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, run, state, opt = built()
    steps(model, run, state, opt, range(6))
    state.drain()
    opt.step()
    straight = [_full(p) for p in model.parameters()]
    model, run, state, opt = built()
    steps(model, run, state, opt, range(3))
    saved = (
        {k: v.clone() for k, v in model.state_dict().items()},
        opt.state_dict(),
        {k: v.clone() for k, v in state.state_dict().items()},
    )
    model, run, state, opt = built()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    if attach:
        state.predict_with(opt)
    try:
        steps(model, run, state, opt, range(3, 6))
    except RuntimeError as e:
        return str(e)
    state.drain()
    opt.step()
    return all(torch.equal(a, _full(b)) for a, b in zip(straight, model.parameters(), strict=True))


@pytest.mark.parametrize("kind, world", [("fsdp2", 3), ("ddp-bf16", 2)])
def test_a_resumed_run_predicts_as_the_saved_one_once_told_its_optimizer(kind, world):
    """Bit for bit where a resume without prediction is (``qsdp-w8g8`` under FSDP2; DDP
    uncompressed on 2 ranks, whose sums do not depend on the buckets DDP rebuilds): before the
    fix the resumed run's first step ran unpredicted and ended elsewhere."""
    for got in run_distributed(_resumed, world, kind, True):
        assert got is True, got
    for got in run_distributed(_resumed, world, kind, False):  # not told: refused
        assert isinstance(got, str) and "state.predict_with(optimizer)" in got, got


def _not_predicting(rank: int, world: int) -> str:
    model, _, state = _staleness_model("fsdp2", qsdp.Schedule(staleness=1, predict="none"))
    try:
        state.predict_with(torch.optim.AdamW(model.parameters()))
    except ValueError as e:
        return str(e)
    return "no error"


def test_predict_with_needs_a_predicting_schedule():
    for got in run_distributed(_not_predicting, 2):
        assert "this model's schedule does not predict" in got, got
