"""[Note: which stream an exchange runs on]: a collective driven to its end at once issues its
``torch.distributed`` calls with ``async_op=False`` (NCCL enqueues them on the current stream,
as FSDP2's own collectives), a deferred one with ``async_op=True`` (the group's stream), and the
two-level reduce-scatter's hops always on their groups' streams. Checked by recording the
``async_op`` every call receives, on gloo, with the results compared to the exact collective."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import qsdp.comm as qc
from qsdp.comm import _common
from qsdp.quant import QuantSpec
from qsdp.testing import rank_tensor, run_distributed

W8 = QuantSpec(bits=8, group_size=16, scheme="absmax", rounding="nearest")
G4 = QuantSpec(bits=4, group_size=16, scheme="absmax", rounding="stochastic")


def _spy(calls: list, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls.append((fn.__name__, kwargs.get("async_op")))
        return fn(*args, **kwargs)

    return wrapper


def _worker(rank: int, ws: int) -> dict:
    calls: list = []
    names = (
        "all_to_all_single",
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
    )
    for name in names:
        if hasattr(dist, name):
            setattr(dist, name, _spy(calls, getattr(dist, name)))
    m = 37
    got = {}

    def run(what, fn):
        calls.clear()
        fn()
        got[what] = [a for _, a in calls]

    x = rank_tensor(rank, ws * m)
    out = torch.empty(m)
    run("reduce_scatter sync", lambda: qc.reduce_scatter(out, x, spec=W8, op="sum", step=1))
    exact = x.clone()
    dist.all_reduce(exact)
    got["rs error"] = float((out - exact[rank * m : (rank + 1) * m]).abs().max())
    got["rs bound"] = float(exact.abs().max()) * ws / 127 * 0.5001 + 1e-6

    out2 = torch.empty(m)

    def async_rs():
        work = qc.reduce_scatter(out2, x, spec=W8, op="sum", step=1, async_op=True)
        got["async pending calls"] = len(calls)
        work.wait()

    run("reduce_scatter async", async_rs)
    got["async equal"] = bool(torch.equal(out, out2))

    shard = rank_tensor(rank, m)
    full = torch.empty(ws * m)
    run("all_gather sync", lambda: qc.all_gather(full, shard, spec=W8))
    full2 = torch.empty(ws * m)
    run("all_gather async", lambda: qc.all_gather(full2, shard, spec=W8, async_op=True).wait())
    got["gather equal"] = bool(torch.equal(full, full2))

    recon = torch.zeros(ws * m)
    full3 = torch.empty(ws * m)
    run(
        "all_gather_diff exact",
        lambda: qc.all_gather_diff(full3, shard, recon, spec=W8, exact=True),
    )
    exact_full = torch.empty(ws * m)
    dist.all_gather_into_tensor(exact_full, shard)
    got["diff exact equal"] = bool(torch.equal(full3, exact_full))
    run("all_gather_diff", lambda: qc.all_gather_diff(full3, shard * 1.5, recon, spec=W8))
    got["diff error"] = float((full3[rank * m : (rank + 1) * m] - shard * 1.5).abs().max())
    got["diff bound"] = float((shard * 0.5).abs().max()) / 127 * 0.5001 + 1e-6
    run("all_gather_payloads", lambda: qc.all_gather_payloads(torch.ones(5, dtype=torch.uint8)))

    t = x.clone()
    run("integer_all_reduce sync", lambda: qc.integer_all_reduce(t, carrier="int32"))

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("inter", "intra"))
    out3 = torch.empty(m)
    run(
        "two-level sync",
        lambda: qc.hierarchical_reduce_scatter(
            out3, x, mesh=mesh, intra_spec=W8, inter_spec=G4, pipeline=2, step=3
        ),
    )
    got["on current stream after"] = _common._issue.on_current_stream
    return got


def test_sync_collectives_issue_on_the_current_stream():
    res = run_distributed(_worker, 4)
    for got in res:
        assert got["rs error"] <= got["rs bound"], got
        assert got["async equal"] and got["gather equal"] and got["diff exact equal"]
        assert got["diff error"] <= got["diff bound"], got
        # synchronous: every exchange issued with async_op False or left out (the current
        # stream), the collective's own among them
        for what in (
            "reduce_scatter sync",
            "all_gather sync",
            "integer_all_reduce sync",
            "all_gather_diff exact",
            "all_gather_diff",
            "all_gather_payloads",
        ):
            assert False in got[what] and True not in got[what], (what, got[what])
        # deferred: the exchange on the group's stream
        assert got["reduce_scatter async"][-1] is True, got["reduce_scatter async"]
        assert got["all_gather async"][-1] is True, got["all_gather async"]
        # the two-level hops: on their groups' streams even when the whole call is synchronous
        hops = got["two-level sync"]
        assert hops.count(True) >= 2, hops
        assert got["on current stream after"] is False


def _fsdp_worker(rank: int, ws: int, staleness: int) -> list:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import qsdp

    calls: list = []
    for name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            setattr(dist, name, _spy(calls, getattr(dist, name)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    schedule = qsdp.Schedule(staleness=staleness, start=0)
    qsdp.compress_fsdp(model, "qsdp-w8g8", schedule=schedule)
    state = qsdp.fsdp.comm_state(model)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 10 + step))
        model(x).pow(2).mean().backward()
    if staleness:
        state.drain()
    return calls


def test_fsdp_hooks_issue_on_the_current_stream():
    """Under FSDP2 every exchange of qsdp's hooks (the weight all-gathers, the gradient
    all-to-alls; at staleness 1 those that run on the delayed reductions' side streams too) is
    issued with async_op=False: on NCCL, on FSDP2's own stream or the side stream it runs on."""
    for staleness in (0, 1):
        for calls in run_distributed(_fsdp_worker, 3, staleness):
            names = {n for n, _ in calls}
            assert "all_to_all_single" in names, calls  # the gradients' exchange was seen
            assert names & {"all_gather_into_tensor", "all_gather_single"}, calls
            assert True not in [a for _, a in calls], (staleness, calls)
