"""Single-level quantized reduce-scatter on real gloo processes: bounds, bytes, ops, async."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import qsdp.comm._reduce_scatter as rs_mod
from qsdp.comm import CommStats, reduce_scatter, reduce_scatter_wire_bytes
from qsdp.comm._common import dist_reduce_scatter, noise_stream
from qsdp.quant import QuantSpec, Rounding, decode_sum, encode
from qsdp.testing import (
    assert_within,
    count_dist_bytes,
    dtype_slack,
    quant_steps,
    rank_tensor,
    rounding_bound,
    run_distributed,
)

from .test_all_gather import mean_error_ok

SPECS = [
    QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest"),
    QuantSpec(bits=8, group_size=32, scheme="minmax", rounding="stochastic"),
    QuantSpec(
        bits=4,
        group_size=64,
        scheme="absmax",
        rounding="stochastic",
        hadamard_block=32,
        hadamard_seed=5,
    ),
    QuantSpec(bits=2, group_size=16, scheme="minmax", rounding="nearest"),
]
CHUNKS = [0, 1, 37, 300]  # elements per destination chunk (input = world_size * m)
SEED, STEP = 4, 9


def is_avg(op) -> bool:
    return op == "avg" if isinstance(op, str) else op == dist.ReduceOp.AVG


def exact_and_bound(xs, r, m, spec, op):
    """Float64 exact reduction of chunk ``r`` and its error bound (quantizer domain)."""
    n = len(xs)
    parts = [x[r * m : (r + 1) * m] for x in xs]
    exact = sum(p.double() for p in parts)
    bound = sum(
        (rounding_bound(p, spec) for j, p in enumerate(parts) if j != r),
        torch.zeros(m, dtype=torch.float64),
    )
    mag = sum(p.double().abs() for p in parts)
    if is_avg(op):
        exact, bound, mag = exact / n, bound / n, mag / n
    return exact, bound, mag


def check_reduce_scatter(rank, ws, spec, m, dtype, op, *, step=STEP, bucket=0, scale=1.0):
    """One reduce-scatter of ``rank_tensor`` inputs times ``scale`` (1e-39: tiny and subnormal
    values, whose floored step bounds the error: the reference's [Note: step floor])."""
    xs = [
        (rank_tensor(j, ws * m, dtype=torch.float64, seed=step) * scale).to(dtype)
        for j in range(ws)
    ]
    out = torch.full((m,), float("nan"), dtype=dtype)
    stats = CommStats()
    with count_dist_bytes() as sent:
        reduce_scatter(
            out,
            xs[rank].clone(),
            spec=spec,
            op=op,
            seed=SEED,
            step=step,
            bucket=bucket,
            stats=stats,
        )
    expect_bytes = reduce_scatter_wire_bytes(ws * m, ws, spec)
    assert sent.total_bytes == stats.total_bytes  # every byte that crossed, counted
    assert stats["reduce_scatter"].bytes == expect_bytes
    assert expect_bytes == (ws - 1) * spec.payload_bytes(m)
    exact, bound, mag = exact_and_bound(xs, rank, m, spec, op)
    assert_within(
        out.double() - exact,
        bound,
        spec,
        slack=dtype_slack(mag, dtype, spec),
        what=f"reduce_scatter {spec} {dtype} op={op}",
    )
    # The same float32 steps from the bytes the peers sent: own chunk exact, peers in rank order.
    acc = xs[rank][rank * m : (rank + 1) * m].to(torch.float32, copy=True)
    rows = [
        encode(
            xs[j][rank * m : (rank + 1) * m],
            spec,
            seed=SEED,
            step=step,
            stream=noise_stream(j, rank, bucket=bucket),
        ).payload
        for j in range(ws)
        if j != rank
    ]
    if rows and m:
        decode_sum(torch.stack(rows), m, spec, out=acc, accumulate=True)
    if is_avg(op):
        acc /= ws
    assert torch.equal(out, acc.to(dtype)), "output differs from the decode of the peers' bytes"
    return out


def _worker(rank, ws):
    for spec in SPECS:
        for m in CHUNKS:
            for dtype in (torch.float32, torch.bfloat16):
                check_reduce_scatter(rank, ws, spec, m, dtype, "avg")
        check_reduce_scatter(rank, ws, spec, 37, torch.float32, "sum")
        for dtype in (torch.float32, torch.bfloat16):
            check_reduce_scatter(rank, ws, spec, 37, dtype, "avg", scale=1e-39)
    check_reduce_scatter(rank, ws, SPECS[1], 37, torch.float32, dist.ReduceOp.SUM)
    check_reduce_scatter(rank, ws, SPECS[1], 37, torch.float32, dist.ReduceOp.AVG)
    _check_async(rank, ws)
    _check_bytes_ratio(rank, ws)
    _check_unbiased(rank, ws)


def _check_async(rank, ws):
    spec, m = SPECS[1], 100
    sync = check_reduce_scatter(rank, ws, spec, m, torch.float32, "avg")
    x = rank_tensor(rank, ws * m, seed=STEP)
    out = torch.empty(m)
    work = reduce_scatter(out, x, spec=spec, seed=SEED, step=STEP, async_op=True)
    x.fill_(1e6)  # encoded and the own chunk copied before the call returned
    work.wait()
    assert work.is_completed()
    assert torch.equal(out, sync)


def _check_bytes_ratio(rank, ws):
    """Against the uncompressed reduce-scatter: the same n - 1 chunks, at the quantized width."""
    m = 4096
    x = rank_tensor(rank, ws * m)
    with count_dist_bytes() as plain:
        dist_reduce_scatter()(torch.empty(m), x.clone())
    for spec in SPECS:
        with count_dist_bytes() as quant:
            reduce_scatter(torch.empty(m), x, spec=spec)
        # both count the n - 1 chunks bound for the peers (qsdp.comm._stats' convention)
        factor = (spec.bits / 8 + spec.scale_bytes / spec.group_size) / 4
        sent = quant.total_bytes - quant.bytes.get("all_reduce", 0)  # less the NaN verdict
        assert sent == round(plain.total_bytes * factor), spec


def _check_unbiased(rank, ws):
    if ws == 1:
        return  # nothing is quantized: the own chunk is exact
    m, k = 200, 64
    x = rank_tensor(rank, ws * m)
    parts = [rank_tensor(j, ws * m)[rank * m : (rank + 1) * m] for j in range(ws)]
    exact = sum(p.double() for p in parts)
    for spec in (SPECS[1], QuantSpec(bits=8, group_size=32, scheme="minmax", rounding="nearest")):
        errs = torch.empty(k, m, dtype=torch.float64)
        for s in range(k):
            out = torch.empty(m)
            reduce_scatter(out, x, spec=spec, op="sum", step=s)
            errs[s] = out.double() - exact
        # Variances add over the peers: sigma of the sum = sqrt(sum step_j^2) / 2.
        steps = torch.sqrt(sum(quant_steps(p, spec) ** 2 for j, p in enumerate(parts) if j != rank))
        assert mean_error_ok(errs, steps) == (spec.rounding is Rounding.STOCHASTIC), spec


def _broken_worker(rank, ws):
    """The checks catch a decode that is 1% off, and an AVG that forgets to divide."""
    real = rs_mod.decode_sum_finish

    def off(*args, **kwargs):
        real(*args, **kwargs)
        kwargs["out"].mul_(1.01)

    with mock.patch.object(rs_mod, "decode_sum_finish", off), pytest.raises(AssertionError):
        check_reduce_scatter(rank, ws, SPECS[0], 50, torch.float32, "avg")

    def no_avg(*args, **kwargs):
        real(*args, **{**kwargs, "divisor": None})

    with mock.patch.object(rs_mod, "decode_sum_finish", no_avg), pytest.raises(AssertionError):
        check_reduce_scatter(rank, ws, SPECS[0], 50, torch.float32, "avg")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter(world_size):
    run_distributed(_worker, world_size)


def test_checks_catch_broken_reduce():
    run_distributed(_broken_worker, 3)


def _backends_worker(rank, ws):
    """The Triton path (one ``encode_rows`` launch for the n - 1 peers' chunks, interpreted on
    the CPU) sends and returns the same bits as the reference's encode per chunk: without and
    with a policy split, stochastic rounding with Hadamard."""
    from qsdp.comm import Split

    spec = SPECS[2]
    m = 97
    split = Split(chunk=m, runs=((0, 10, False), (10, 60, True), (70, 3, False), (73, 24, True)))
    x = rank_tensor(rank, ws * m, dtype=torch.float32, seed=3).to(torch.bfloat16)
    got = {}
    for backend in ("reference", "triton"):
        for name, sp in (("whole", None), ("split", split)):
            out = torch.empty(m, dtype=torch.bfloat16)
            with count_dist_bytes() as sent:
                reduce_scatter(
                    out, x.clone(), spec=spec, split=sp, seed=SEED, step=2, backend=backend
                )
            got[backend, name] = (out, sent.total_bytes)
    for name in ("whole", "split"):
        ref_out, ref_sent = got["reference", name]
        tri_out, tri_sent = got["triton", name]
        assert torch.equal(ref_out.view(torch.int16), tri_out.view(torch.int16)), name
        assert ref_sent == tri_sent > 0, name
    return True


def test_one_launch_encodes_give_the_reference_bits():
    assert all(run_distributed(_backends_worker, 3))
