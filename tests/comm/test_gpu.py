"""GPU tier: the collectives on NCCL with the Triton kernels, against the torch reference
backend on the same GPUs and against the exact NCCL collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import qsdp.comm as qc
from qsdp.comm._common import dist_all_gather, dist_reduce_scatter
from qsdp.quant import QuantSpec
from qsdp.testing import assert_same_on_all_ranks, rank_tensor, run_distributed

pytestmark = pytest.mark.gpu

W8 = QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest")
G4 = QuantSpec(
    bits=4,
    group_size=128,
    scheme="absmax",
    rounding="stochastic",
    hadamard_block=32,
    hadamard_seed=1,
)
G8 = QuantSpec(
    bits=8,
    group_size=128,
    scheme="absmax",
    rounding="stochastic",
    hadamard_block=32,
    hadamard_seed=1,
)
M8 = QuantSpec(bits=8, group_size=64, scheme="minmax", rounding="stochastic")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        diff = float((a.double() - b.double()).abs().max())
        raise AssertionError(f"{what}: triton and reference backends differ (max {diff:.3g})")


def _worker(rank, ws):
    dev = torch.device("cuda", torch.cuda.current_device())
    m = 4096 * 3 + 77  # not a multiple of the group size
    for dtype in (torch.float32, torch.bfloat16):
        shard = rank_tensor(rank, m, dtype=dtype).to(dev)
        exact = torch.empty(ws * m, dtype=dtype, device=dev)
        dist_all_gather()(exact, shard)
        outs = {}
        for backend in ("auto", "reference"):
            outs[backend] = torch.empty(ws * m, dtype=dtype, device=dev)
            qc.all_gather(outs[backend], shard, spec=W8, step=1, backend=backend)
        _same(outs["auto"], outs["reference"], "all_gather")
        assert_same_on_all_ranks(outs["auto"])
        assert _rel(outs["auto"], exact) < 0.02

        x = rank_tensor(rank, ws * m, dtype=dtype).to(dev)
        exact = torch.empty(m, dtype=torch.float32, device=dev)
        dist_reduce_scatter()(exact, x.float(), op=dist.ReduceOp.AVG)
        for spec in (M8, G4):
            for backend in ("auto", "reference"):
                outs[backend] = torch.empty(m, dtype=dtype, device=dev)
                qc.reduce_scatter(outs[backend], x, spec=spec, step=2, backend=backend)
            _same(outs["auto"], outs["reference"], f"reduce_scatter {spec}")
            assert _rel(outs["auto"], exact) < (0.05 if spec.bits == 8 else 0.4)

        shape = (2, ws // 2) if ws % 2 == 0 and ws >= 4 else (1, ws)
        mesh = init_device_mesh("cuda", shape, mesh_dim_names=("inter", "intra"))
        for pipeline in (1, 3):
            for backend in ("auto", "reference"):
                outs[backend] = torch.empty(m, dtype=dtype, device=dev)
                qc.hierarchical_reduce_scatter(
                    outs[backend],
                    x,
                    mesh=mesh,
                    intra_spec=G8,
                    inter_spec=G4,
                    pipeline=pipeline,
                    step=3,
                    backend=backend,
                )
            _same(outs["auto"], outs["reference"], f"two-level pipeline={pipeline}")
            assert _rel(outs["auto"], exact) < 0.4

        t = x.clone()
        qc.integer_all_reduce(t, carrier="int8")
        full = x.float().clone()
        dist.all_reduce(full, op=dist.ReduceOp.AVG)
        assert _rel(t, full) < 0.2
        assert_same_on_all_ranks(t)
        out = torch.empty(m, dtype=dtype, device=dev)
        qc.integer_reduce_scatter(out, x, carrier="fp16")
        assert _rel(out, exact) < 0.2
        for backend in ("auto", "reference"):
            outs[backend] = x.clone()
            qc.two_phase_all_reduce(outs[backend], spec=M8, step=4, backend=backend)
        _same(outs["auto"], outs["reference"], "two_phase")
        assert_same_on_all_ranks(outs["auto"])
        assert _rel(outs["auto"], full) < 0.05

    # async on CUDA streams: the handle's wait orders the decode before later work.
    shard = rank_tensor(rank, m).to(dev)
    sync = torch.empty(ws * m, device=dev)
    qc.all_gather(sync, shard, spec=W8)
    out = torch.empty(ws * m, device=dev)
    work = qc.all_gather(out, shard, spec=W8, async_op=True)
    busy = torch.randn(2048, 2048, device=dev) @ torch.randn(2048, 2048, device=dev)
    work.wait()
    assert torch.equal(out, sync) and busy.isfinite().all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_collectives_on_nccl():
    run_distributed(_worker, min(4, torch.cuda.device_count()), backend="nccl", timeout_s=600)


def _kernel_streams(prof, tmp: str) -> dict[str, set[int]]:
    """Each kernel name's CUDA streams in a profile (its Chrome trace's ``args.stream``)."""
    import json

    prof.export_chrome_trace(tmp)
    with open(tmp) as f:
        events = json.load(f)["traceEvents"]
    streams: dict[str, set[int]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            streams.setdefault(e["name"], set()).add(e["args"]["stream"])
    return streams


def _stream_worker(rank, ws, tmp):
    """[Note: which stream an exchange runs on]: a synchronous collective's NCCL kernel runs
    on the stream of its encode (the current one), an async one's on another."""
    dev = torch.device("cuda", torch.cuda.current_device())
    m = 4096 * 3 + 77
    x = rank_tensor(rank, ws * m).to(dev)
    shard = rank_tensor(rank, m).to(dev)
    side = torch.cuda.Stream()
    seen = {}
    for mode in ("sync", "async"):
        out = torch.empty(m, device=dev)
        full = torch.empty(ws * m, device=dev)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.cuda.stream(side):
                works = [
                    qc.reduce_scatter(out, x, spec=M8, step=1, async_op=mode == "async"),
                    qc.all_gather(full, shard, spec=W8, async_op=mode == "async"),
                ]
                for w in works:
                    if w is not None:
                        w.wait()
            torch.cuda.synchronize()
        streams = _kernel_streams(prof, f"{tmp}/trace_{rank}_{mode}.json")
        encode = set().union(*(s for k, s in streams.items() if "encode" in k))
        # the exchanges themselves (a NaN/Inf agreement's all-reduce runs where it is called)
        nccl = set().union(
            *(
                s
                for k, s in streams.items()
                if k.startswith(("ncclDevKernel_SendRecv", "ncclDevKernel_AllGather"))
            )
        )
        seen[mode] = (encode, nccl)
    (enc_s, nccl_s), (enc_a, nccl_a) = seen["sync"], seen["async"]
    assert len(enc_s) == 1 and nccl_s == enc_s, seen
    assert len(enc_a) == 1 and nccl_a and not (nccl_a & enc_a), seen


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_sync_exchanges_run_on_the_current_stream(tmp_path):
    run_distributed(_stream_worker, 2, str(tmp_path), backend="nccl", timeout_s=300)
