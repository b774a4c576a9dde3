"""Compressed HSDP: shard inside a node, compress the replicate all-reduce across nodes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import qsdp
from qsdp.testing import assert_same_on_all_ranks, run_distributed

from ..models import batch as _batch
from ..models import dist_calls, flag_groups, nan_gradient, sharded_classifier, train

STEPS = 25


def _worker(rank: int, world: int, shape: tuple[int, int]) -> dict:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    native = sharded_classifier(mesh)  # FSDP2's own HSDP, uncompressed
    qsdp.compress_fsdp(native, "bf16")
    out = {"native": train(native, rank, STEPS)[-1]}
    for recipe in ("cgx", "global-qsgd", "qsdp-g8"):
        model = sharded_classifier(mesh["shard"])
        qsdp.compress_fsdp(model, recipe, replicate=mesh["replicate"])
        out[recipe] = train(model, rank, STEPS)[-1]
        for p in model.parameters():  # the replicas of each shard stay bit-identical
            assert_same_on_all_ranks(p.to_local().detach(), group=mesh.get_group(0))
        stats = qsdp.fsdp_comm_stats(model)
        plan = qsdp.recipe(recipe).grads.plan()
        hooks = qsdp.fsdp._state._installed(model).hooks
        expect = sum(
            plan.all_reduce_wire_bytes(
                sum(p.to_local().numel() for p in group.params), shape[0], split=h.split
            )
            for h, group in zip(hooks, qsdp.fsdp.fsdp_groups(model), strict=True)
        )
        name = "integer_all_reduce" if recipe == "global-qsgd" else "two_phase_all_reduce"
        before = stats[name].bytes
        x, y = _batch(rank, 99)
        nn.functional.cross_entropy(model(x), y).backward()
        assert stats[name].bytes - before == expect > 0, (recipe, stats[name].bytes - before)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_compressed_hsdp_trains_like_native_hsdp(shape):
    for out in run_distributed(_worker, shape[0] * shape[1], shape):
        for recipe in ("cgx", "global-qsgd", "qsdp-g8"):
            rel = (out[recipe] - out["native"]) / out["native"]
            assert abs(rel) < 0.03, f"{recipe}: {out[recipe]:.4f} vs native {out['native']:.4f}"


def _pipelined(rank: int, world: int) -> None:
    # [Note: pipelined modules]: the later exchange on a second communicator over the replicate
    # ranks, the same training bit for bit (gloo has no streams to alternate)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh["replicate"].get_group()
    gather = qsdp.comm.dist_all_gather().__name__  # this torch's all-gather into one tensor
    across = dist.get_process_group_ranks(replicate)
    for recipe in ("cgx", "global-qsgd"):
        out = []
        for pipeline in (False, True):
            model = sharded_classifier(mesh["shard"])
            qsdp.compress_fsdp(
                model,
                recipe,
                replicate=mesh["replicate"],
                schedule=qsdp.Schedule(pipeline=pipeline),
            )
            with dist_calls(gather) as calls:
                losses = train(model, rank, 6)
            # the all-gathers across the nodes (FSDP2's own weight gathers stay in the node)
            groups = [c["group"] for c in calls]
            seen = [g for g in groups if dist.get_process_group_ranks(g) == across]
            hooks = qsdp.fsdp._state._installed(model).hooks
            second = {h.second_group for h in hooks}
            out.append((losses, [p.to_local().detach().clone() for p in model.parameters()]))
            if not pipeline:
                assert second == {None}
                if recipe == "cgx":  # CGX's phase 2 on the replicate communicator
                    assert seen and all(g is replicate for g in seen), seen
                continue
            (twin,) = second
            assert twin is not replicate
            assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(replicate)
            if recipe == "cgx":  # ... and now on its twin, every time
                assert seen and all(g is twin for g in seen), seen
        (plain, plain_params), (piped, piped_params) = out
        assert plain == piped, (recipe, plain, piped)
        for a, b in zip(plain_params, piped_params, strict=True):
            assert torch.equal(a, b)


def test_pipelined_hsdp_trains_the_same_bits():
    run_distributed(_pipelined, 4)


def _refusals(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="native HSDP"):
        qsdp.compress_fsdp(sharded_classifier(mesh), "cgx", replicate=mesh["replicate"])
    with pytest.raises(ValueError, match="TwoLevelGrads is a reduce-scatter"):
        qsdp.compress_fsdp(
            sharded_classifier(mesh["shard"]), "tlq-hs-only", replicate=mesh["replicate"]
        )
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        qsdp.compress_fsdp(sharded_classifier(mesh["shard"]), "cgx", replicate=mesh)
    with pytest.raises(ValueError, match="pipelines compressed HSDP's replicate all-reduce"):
        qsdp.compress_fsdp(
            sharded_classifier(mesh["shard"]), "cgx", schedule=qsdp.Schedule(pipeline=True)
        )
    with pytest.raises(ValueError, match="this config's gradients are uncompressed"):
        qsdp.compress_fsdp(
            sharded_classifier(mesh["shard"]),
            "bf16",
            replicate=mesh["replicate"],
            schedule=qsdp.Schedule(pipeline=True),
        )
    stale = qsdp.Schedule(staleness=1, pipeline=True, start=0, predict="none")
    with pytest.raises(ValueError, match="with staleness=1"):
        qsdp.compress_fsdp(
            sharded_classifier(mesh["shard"]), "cgx", replicate=mesh["replicate"], schedule=stale
        )


def test_hsdp_refusals():
    run_distributed(_refusals, 2)


def _nan(rank: int, world: int, mode: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = sharded_classifier(mesh["shard"])
    qsdp.compress_fsdp(model, qsdp.recipe("cgx", nonfinite=mode), replicate=mesh["replicate"])
    shard = mesh["shard"].get_group()
    if rank == 1:  # NaN in a sharded Linear's gradient: it reaches its shard's replica only
        nan_gradient(model[5])
    x, y = _batch(rank, 1)
    out = {"error": None}
    with flag_groups() as seen:  # where each NaN-flag MAX ran
        nn.functional.cross_entropy(model(x), y).backward()
    # zeroed on the device when the backward ended, on every rank; the host reads the verdict
    # at check_nonfinite() (or when the next backward ends)
    out["finite"] = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
    try:
        qsdp.fsdp.comm_state(model).check_nonfinite()
    except ValueError as e:
        out["error"] = str(e)
    # every module's flags in one MAX over the shard's ranks, then one over the replicas', when
    # the backward ends, none between two modules' inter-node exchanges ([Note: one flag
    # agreement per backward])
    assert len(seen) == 2, seen
    assert dist.get_process_group_ranks(seen[0]) == dist.get_process_group_ranks(shard)
    replicate = mesh["replicate"].get_group()
    assert dist.get_process_group_ranks(seen[1]) == dist.get_process_group_ranks(replicate)
    hooks = qsdp.fsdp._state._installed(model).hooks
    out["zeroed"] = sum(h.zeroed for h in hooks)
    return out


def _diverged(rank: int, world: int) -> str | None:
    """A replica whose all-reduce result turns NaN where its twin's does not (what a broken
    exchange or a memory race would leave): the verdict must still be every rank's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = sharded_classifier(mesh["shard"])
    qsdp.compress_fsdp(model, "cgx", replicate=mesh["replicate"])
    if rank == 2:  # rank 0's replica: after its all-reduce, one value of module 5 goes bad
        hook = model[5]._get_fsdp_state()._fsdp_param_group._all_reduce_hook
        plan_now = hook._plan_now

        class Corrupted:
            def __init__(self, plan) -> None:
                self.plan = plan

            def all_reduce(self, tensor: torch.Tensor, *args, **kwargs) -> None:
                self.plan.all_reduce(tensor, *args, **kwargs)
                tensor.view(-1)[0] = float("nan")

        hook._plan_now = lambda *args: Corrupted(plan_now(*args))
    x, y = _batch(rank, 1)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        qsdp.fsdp.comm_state(model).check_nonfinite()
    except ValueError as e:
        return str(e)
    return None


def test_replicas_that_differ_still_raise_on_every_rank():
    for err in run_distributed(_diverged, 4, pg_timeout_s=30):
        assert err is not None and "non-finite gradient" in err, err


def test_nan_on_one_rank_same_outcome_everywhere_under_hsdp():
    for out in run_distributed(_nan, 4, "raise", pg_timeout_s=30):
        assert out["error"] is not None and "non-finite gradient" in out["error"], out
        assert out["finite"], out  # zeroed before the raise
    for out in run_distributed(_nan, 4, "zero", pg_timeout_s=30):
        assert out["error"] is None and out["finite"] and out["zeroed"] == 1, out
