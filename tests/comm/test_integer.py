"""Global-QSGD integer all-reduce / reduce-scatter: exact carrier sums on adversarial inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qsdp.comm import (
    CommStats,
    integer_all_reduce,
    integer_all_reduce_wire_bytes,
    integer_reduce_scatter,
    integer_reduce_scatter_wire_bytes,
)
from qsdp.comm._common import noise_stream
from qsdp.comm._integer import levels_for
from qsdp.quant import (
    CARRIERS,
    STEP_FLOOR,
    global_int_decode,
    global_int_encode,
    global_int_levels,
    group_absmax,
)
from qsdp.testing import assert_same_on_all_ranks, count_dist_bytes, rank_tensor, run_distributed

from .test_all_gather import mean_error_ok

SEED, STEP, G = 2, 5, 32


def adversarial(kind: str, rank: int, ws: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inputs that break a naive integer sum: every rank at +max (or -max), mixed signs, one
    rank many orders of magnitude above the others, tiny and subnormal values (whose ``s / M``
    overflowed before the step floor), and plain random data."""
    big = 3.0e4 if dtype == torch.float16 else 1.0e30
    if kind == "all+max":
        x = torch.full((numel,), 7.5, dtype=torch.float64)
    elif kind == "all-max":
        x = torch.full((numel,), -7.5, dtype=torch.float64)
    elif kind == "mixed":
        sign = (-1.0) ** (torch.arange(numel) + rank)
        x = sign.double() * 7.5
    elif kind == "tiny":
        x = rank_tensor(rank, numel, seed=STEP) * 1e-39
        x[::5] = 0.0
    elif kind == "one-huge":
        x = rank_tensor(rank, numel, seed=STEP, outliers=0)
        if rank == ws - 1:
            x = x * big
    else:
        x = rank_tensor(rank, numel, seed=STEP)
    return x.to(dtype)


KINDS = ["all+max", "all-max", "mixed", "one-huge", "tiny", "random"]


def expected(xs, carrier, rounding, *, op, chunk=None, m=None):
    """Decoded exact integer sum of the codes every rank sends (int64: no wrap possible)."""
    n = len(xs)
    if chunk is not None:
        xs = [x[chunk * m : (chunk + 1) * m] for x in xs]
    scales = torch.stack([group_absmax(x, G) for x in xs]).amax(dim=0)
    levels = levels_for(carrier, n)
    codes = [
        global_int_encode(
            x,
            scales,
            levels,
            carrier=carrier,
            group_size=G,
            rounding=rounding,
            seed=SEED,
            step=STEP,
            stream=noise_stream(j, 0 if chunk is None else chunk),
        ).long()
        for j, x in enumerate(xs)
    ]
    total = sum(codes)
    limit = CARRIERS[carrier][1]
    assert bool((total.abs() <= limit).all()), "the level rule let a carrier sum overflow"
    out = global_int_decode(total, scales, levels, world_size=n, group_size=G, op=op)
    # Per-rank rounding error: half a level (nearest) or one level (stochastic) of M / s,
    # floored at 2^-126 ([Note: step floor] in qsdp.quant.reference).
    per_rank = (scales.double() / levels).clamp(min=STEP_FLOOR).repeat_interleave(G)[: out.numel()]
    bound = n * per_rank * (0.5 if rounding == "nearest" else 1.0)
    # float32 scaling x * s / M: a few units of M * 2^-24 per rank (visible at 2^24 levels only).
    bound += n * scales.double().repeat_interleave(G)[: out.numel()] * 2.0**-22
    exact = sum(x.double() for x in xs)
    if op == "avg":
        exact, bound = exact / n, bound / n
    return out, exact, bound


def tiny_slack(dtype: torch.dtype, n: int) -> float:
    """Rounding below the normal ranges: float32's (2^-149 per operation, ``n`` ranks) and the
    output dtype's (half its smallest subnormal)."""
    info = torch.finfo(dtype)
    return 4 * n * 2.0**-149 + info.smallest_normal * info.eps / 2


def _check_all_reduce(rank, ws, kind, carrier, rounding, dtype, numel, op="avg"):
    xs = [adversarial(kind, j, ws, numel, dtype) for j in range(ws)]
    t = xs[rank].clone()
    stats = CommStats()
    with count_dist_bytes() as sent:
        integer_all_reduce(
            t,
            carrier=carrier,
            op=op,
            group_size=G,
            rounding=rounding,
            seed=SEED,
            step=STEP,
            stats=stats,
        )
    wire = integer_all_reduce_wire_bytes(numel, carrier=carrier, group_size=G)
    assert sent.total_bytes == stats.total_bytes  # every byte that crossed, counted
    assert stats["integer_all_reduce"].bytes == wire
    out, exact, bound = expected(xs, carrier, rounding, op=op)
    assert torch.equal(t, out.to(dtype)), f"{kind} {carrier}: not the exact integer sum"
    if kind != "one-huge" or dtype == torch.float32:
        slack = exact.abs() * torch.finfo(dtype).eps + tiny_slack(dtype, ws)
        assert bool(((t.double() - exact).abs() <= bound + slack).all()), (kind, carrier)
    if kind in ("all+max", "all-max"):  # every code is +-s: the carrier holds +-n*s, no wrap
        want = xs[rank].double() * (ws if op == "sum" else 1)
        assert torch.allclose(t.double(), want, rtol=4 * torch.finfo(dtype).eps, atol=0)


def _check_reduce_scatter(rank, ws, kind, carrier, rounding, dtype, m):
    xs = [adversarial(kind, j, ws, ws * m, dtype) for j in range(ws)]
    out = torch.full((m,), float("nan"), dtype=dtype)
    stats = CommStats()
    with count_dist_bytes() as sent:
        integer_reduce_scatter(
            out,
            xs[rank],
            carrier=carrier,
            group_size=G,
            rounding=rounding,
            seed=SEED,
            step=STEP,
            stats=stats,
        )
    wire = integer_reduce_scatter_wire_bytes(ws * m, ws, carrier=carrier, group_size=G)
    assert sent.total_bytes == stats.total_bytes  # every byte that crossed, counted
    assert stats["integer_reduce_scatter"].bytes == wire
    expect, exact, bound = expected(xs, carrier, rounding, op="avg", chunk=rank, m=m)
    assert torch.equal(out, expect.to(dtype)), f"{kind} {carrier}: not the exact integer sum"
    if kind != "one-huge":
        slack = exact.abs() * torch.finfo(dtype).eps + tiny_slack(dtype, ws)
        assert bool(((out.double() - exact).abs() <= bound + slack).all()), (kind, carrier)


def _check_nonfinite(rank, ws):
    """NaN on one rank: every rank raises (the MAX of scales carries it), nobody hangs."""
    t = rank_tensor(rank, 100)
    if rank == ws - 1:
        t[17] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        integer_all_reduce(t)
    out, x = torch.empty(40), rank_tensor(rank, ws * 40)
    if rank == 0:
        x[3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        integer_reduce_scatter(out, x)
    integer_all_reduce(rank_tensor(rank, 10))  # the group is still usable
    # "propagate": no host check; the NaN group decodes to NaN, the other groups stay exact-ish
    t = rank_tensor(rank, 300)
    if rank == ws - 1:
        t[17] = float("nan")
    integer_all_reduce(t, nonfinite="propagate", group_size=128)
    assert not bool(t[:128].isfinite().any()) and bool(t[128:].isfinite().all())
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'propagate'"):
        integer_reduce_scatter(out, x, nonfinite="zero")


def _check_async_and_unbiased(rank, ws):
    x = rank_tensor(rank, 300)
    sync = x.clone()
    integer_all_reduce(sync, step=1)
    t = x.clone()
    work = integer_all_reduce(t, step=1, async_op=True)
    work.wait()
    assert work.is_completed() and torch.equal(t, sync)
    k = 64
    xs = [rank_tensor(j, 300) for j in range(ws)]
    exact = sum(v.double() for v in xs) / ws
    errs = torch.stack([_mean_at(x, s) - exact for s in range(k)])
    scales = torch.stack([group_absmax(v, 128) for v in xs]).amax(dim=0)
    level = scales.repeat_interleave(128)[:300].double() / global_int_levels("int8", ws)
    # The mean of ws independent roundings of one level each: sigma <= level / (2 sqrt(ws)).
    assert mean_error_ok(errs, level / ws**0.5)


def _mean_at(x, step):
    t = x.clone()
    integer_all_reduce(t, step=step)
    return t.double()


def _worker(rank, ws):
    for kind in KINDS:
        for carrier in ("int8", "fp16", "int32"):
            for rounding in ("nearest", "stochastic"):
                _check_all_reduce(rank, ws, kind, carrier, rounding, torch.float32, 77)
                _check_reduce_scatter(rank, ws, kind, carrier, rounding, torch.float32, 45)
        _check_all_reduce(rank, ws, kind, "int8", "stochastic", torch.bfloat16, 130, op="sum")
        _check_reduce_scatter(rank, ws, kind, "fp16", "nearest", torch.bfloat16, 33)
    _check_all_reduce(rank, ws, "random", "int8", "stochastic", torch.float32, 0)
    _check_reduce_scatter(rank, ws, "random", "int8", "stochastic", torch.float32, 0)
    _check_nonfinite(rank, ws)
    _check_async_and_unbiased(rank, ws)
    _check_bytes_ratio(rank, ws)


def _check_bytes_ratio(rank, ws):
    """An int8 carrier sends a quarter of fp32's bytes plus 4 bytes of scale per group."""
    n = 32 * 1024
    with count_dist_bytes() as sent:
        integer_all_reduce(rank_tensor(rank, n), group_size=128)
    assert sent.total_bytes == n * (1 / 4 + 1 / 128) * 4


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_integer_collectives(world_size):
    run_distributed(_worker, world_size)


def _second_group(rank: int, world: int) -> str:
    import qsdp.comm._common as common
    from qsdp.comm import CommStats, Split

    split = Split(chunk=301, runs=((0, 10, False), (10, 200, True), (210, 91, False)))
    second = dist.new_group(list(range(world)))
    x = torch.randn(301, generator=torch.Generator().manual_seed(11 + rank))
    calls: list[tuple[str, object]] = []  # (op, group) of every all-reduce
    real = common.all_reduce
    common.all_reduce = lambda t, op, group, *a: (
        calls.append((str(op), group)) or real(t, op, group, *a)
    )
    try:
        world_pg = dist.group.WORLD
        for layout in (None, split):
            runs = {}
            for label, pg2 in (("one", None), ("two", second)):
                calls.clear()
                t, stats = x.clone(), CommStats()
                integer_all_reduce(
                    t, split=layout, step=2, stats=stats, async_op=True, second_group=pg2
                ).wait()
                runs[label] = (t, stats.total_bytes)
                later = pg2 or world_pg  # the SUM (and the raw part) on the second communicator
                want = [("RedOpType.MAX", world_pg), ("RedOpType.SUM", later)]
                want += [("RedOpType.SUM", later)] if layout is not None else []
                assert [(op, g or world_pg) for op, g in calls] == want, calls
            assert torch.equal(runs["one"][0], runs["two"][0]), layout
            assert runs["one"][1] == runs["two"][1] > 0
            assert_same_on_all_ranks(runs["two"][0])
    finally:
        common.all_reduce = real
    pair = dist.new_group([0, 1])
    message = ""
    if rank < 2:
        try:
            integer_all_reduce(x.clone(), pair, second_group=dist.group.WORLD)
        except ValueError as e:
            message = str(e)
    t = x.clone()
    integer_all_reduce(t, second_group=second)  # the next call's collectives still match
    assert_same_on_all_ranks(t)
    return message


def test_a_second_communicator_for_the_sum_changes_nothing_but_the_queue():
    messages = run_distributed(_second_group, 3)
    assert messages[2] == ""
    for m in messages[:2]:
        assert "second_group holds the ranks [0, 1, 2], the all-reduce's group [0, 1]" in m, m
