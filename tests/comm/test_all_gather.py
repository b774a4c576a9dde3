"""Quantized all-gather on real gloo processes: bounds, bit-identical replicas, bytes, async."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

import qsdp.comm._all_gather as ag_mod
from qsdp.comm import CommStats, all_gather, all_gather_wire_bytes, comm_stats
from qsdp.comm._common import dist_all_gather, noise_stream
from qsdp.quant import QuantSpec, Rounding, decode_rows, decode_sum, encode
from qsdp.testing import (
    assert_same_on_all_ranks,
    assert_within,
    count_dist_bytes,
    dtype_slack,
    quant_steps,
    rank_tensor,
    rounding_bound,
    run_distributed,
)

SPECS = [
    QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest"),
    QuantSpec(bits=4, group_size=32, scheme="minmax", rounding="stochastic"),
    QuantSpec(
        bits=4,
        group_size=64,
        scheme="absmax",
        rounding="stochastic",
        hadamard_block=32,
        hadamard_seed=7,
    ),
    QuantSpec(
        bits=2, group_size=16, scheme="absmax", rounding="nearest", scale_dtype=torch.bfloat16
    ),
    QuantSpec(bits=8, group_size=64, scheme="shift-lattice", rounding="nearest"),
]
LENGTHS = [0, 1, 37, 1000]  # per-rank shard: empty, shorter than a group, not a multiple of one
DTYPES = [torch.float32, torch.bfloat16]
SEED, STEP = 11, 3


def check_all_gather(rank, ws, spec, m, dtype, *, step=STEP, bucket=0) -> torch.Tensor:
    """One all-gather against the exact one; returns the output."""
    xs = [rank_tensor(j, m, dtype=dtype, seed=step) for j in range(ws)]
    out = torch.full((ws * m,), float("nan"), dtype=dtype)
    stats = CommStats()
    with count_dist_bytes() as sent:
        all_gather(out, xs[rank], spec=spec, seed=SEED, step=step, bucket=bucket, stats=stats)
    assert sent.total_bytes == stats.total_bytes  # every byte that crossed, counted
    assert stats["all_gather"].bytes == all_gather_wire_bytes(m, spec)
    assert stats["all_gather"].calls == 1
    assert stats["all_gather"].dist_calls == (1 if m else 0)
    for j in range(ws):
        got = out[j * m : (j + 1) * m]
        assert_within(
            got.double() - xs[j].double(),
            rounding_bound(xs[j], spec),
            spec,
            slack=dtype_slack(xs[j].abs(), dtype, spec),
            what=f"shard {j} ({spec}, {dtype})",
        )
        # The bytes rank j sent, decoded here: the stream is keyed by j's rank and the bucket.
        payload = encode(
            xs[j], spec, seed=SEED, step=step, stream=noise_stream(j, 0, bucket=bucket)
        ).payload
        expect = decode_sum(payload.view(1, -1), m, spec).to(dtype)
        assert torch.equal(got, expect), f"shard {j} is not the decode of rank {j}'s payload"
    assert_same_on_all_ranks(out)
    return out


def _worker(rank, ws):
    for spec in SPECS:
        for m in LENGTHS:
            for dtype in DTYPES:
                check_all_gather(rank, ws, spec, m, dtype)
    _check_async(rank, ws)
    _check_bytes_ratio(rank, ws)
    _check_default_stats(rank, ws)
    _check_unbiased(rank, ws)


def _check_async(rank, ws):
    spec, m = SPECS[1], 300
    x = rank_tensor(rank, m, seed=STEP)
    sync = check_all_gather(rank, ws, spec, m, torch.float32)
    out = torch.empty(ws * m)
    work = all_gather(out, x.clone(), spec=spec, seed=SEED, step=STEP, async_op=True)
    x.zero_()  # the input is encoded before the call returns
    assert work.wait() is True
    assert work.is_completed()
    assert torch.equal(out, sync)


def _check_bytes_ratio(rank, ws):
    """The wire is the quantizer's fraction of the uncompressed all-gather's bytes."""
    m = 4096
    x = rank_tensor(rank, m)
    with count_dist_bytes() as plain:
        dist_all_gather()(torch.empty(ws * m), x)
    for spec in SPECS:
        with count_dist_bytes() as quant:
            all_gather(torch.empty(ws * m), x, spec=spec)
        factor = (spec.bits / 8 + spec.scale_bytes / spec.group_size) / 4
        sent = quant.total_bytes - quant.bytes.get("all_reduce", 0)  # less the NaN verdict
        assert sent == math.ceil(plain.total_bytes * factor), spec


def _check_default_stats(rank, ws):
    comm_stats.reset()
    all_gather(torch.empty(ws * 10), rank_tensor(rank, 10), spec=SPECS[0])
    all_gather(torch.empty(ws * 10), rank_tensor(rank, 10), spec=SPECS[0])
    counts = comm_stats["all_gather"]
    assert (counts.calls, counts.bytes) == (2, 2 * all_gather_wire_bytes(10, SPECS[0]))
    comm_stats.reset()
    assert comm_stats.total_bytes == 0


def mean_error_ok(errs: torch.Tensor, steps: torch.Tensor) -> bool:
    """Per element, is the mean of K stochastic-rounding errors within 6 sigma of zero?

    ``errs`` is [K, n]; one rounding has variance at most ``step^2 / 4``.
    """
    k = errs.shape[0]
    sigma = steps / 2 / math.sqrt(k)
    return bool((errs.mean(dim=0).abs() <= 6 * sigma + 1e-9).all())


def _check_unbiased(rank, ws):
    """Averaged over steps (fresh noise), stochastic rounding is unbiased; nearest is not."""
    m, k = 256, 64
    for spec in (SPECS[1], QuantSpec(bits=4, group_size=32, scheme="minmax", rounding="nearest")):
        x = rank_tensor(0, m)  # the same shard each step: only the noise changes
        errs = torch.empty(k, ws * m, dtype=torch.float64)
        for s in range(k):
            out = torch.empty(ws * m)
            all_gather(out, x, spec=spec, step=s)
            errs[s] = out.double() - x.double().repeat(ws)
        if spec.rounding is Rounding.STOCHASTIC:  # same shard everywhere, independent noise
            shards = errs.view(k, ws, m)
            assert all(not torch.equal(shards[:, 0], shards[:, j]) for j in range(1, ws))
        stochastic = spec.rounding is Rounding.STOCHASTIC
        assert mean_error_ok(errs, quant_steps(x, spec).repeat(ws)) == stochastic, spec


def _broken_decode_worker(rank, ws):
    """The checks catch a decode that is 1% off."""
    real = decode_rows

    def off(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.mul_(1.01)

    with mock.patch.object(ag_mod, "decode_rows", off):
        with pytest.raises(AssertionError):
            check_all_gather(rank, ws, SPECS[0], 200, torch.float32)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_gather(world_size):
    run_distributed(_worker, world_size)


def test_checks_catch_broken_decode():
    run_distributed(_broken_decode_worker, 2)
