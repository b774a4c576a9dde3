"""CGX's two-phase all-reduce: quantized reduce-scatter + all-gather, identical on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import qsdp.comm as qc
from qsdp.comm import CommStats, two_phase_all_reduce, two_phase_all_reduce_wire_bytes
from qsdp.comm._common import noise_stream
from qsdp.quant import QuantSpec, decode_sum, encode
from qsdp.testing import (
    assert_same_on_all_ranks,
    assert_within,
    count_dist_bytes,
    dtype_slack,
    rank_tensor,
    rounding_bound,
    run_distributed,
)

from .test_all_gather import mean_error_ok

SPECS = [
    QuantSpec(bits=8, group_size=64, scheme="minmax", rounding="stochastic"),
    QuantSpec(bits=4, group_size=32, scheme="absmax", rounding="nearest"),
    QuantSpec(
        bits=4,
        group_size=64,
        scheme="absmax",
        rounding="stochastic",
        hadamard_block=32,
        hadamard_seed=1,
    ),
]
LENGTHS = [0, 1, 5, 301, 1000]  # any length: padded to world_size * ceil(n / world_size) inside
SEED, STEP = 8, 2


def emulate(xs, spec, op, *, step):
    """Expected result from the bytes of both phases, and the per-element error bound."""
    n, numel = len(xs), xs[0].numel()
    m = -(-numel // n)
    pad = [torch.cat((x, x.new_zeros(n * m - numel))) for x in xs]
    out = torch.empty(n * m, dtype=torch.float64)
    bound = torch.empty(n * m, dtype=torch.float64)
    for c in range(n):
        parts = [p[c * m : (c + 1) * m] for p in pad]
        acc = parts[c].to(torch.float32, copy=True)
        rows = [
            encode(parts[j], spec, seed=SEED, step=step, stream=noise_stream(j, c)).payload
            for j in range(n)
            if j != c
        ]
        if rows and m:
            decode_sum(torch.stack(rows), m, spec, out=acc, accumulate=True)
        rs_bound = sum(
            (rounding_bound(parts[j], spec) for j in range(n) if j != c),
            torch.zeros(m, dtype=torch.float64),
        )
        if op == "avg":
            acc /= n
            rs_bound /= n
        payload = encode(acc, spec, seed=SEED, step=step, stream=noise_stream(c, 0, hop=1))
        out[c * m : (c + 1) * m] = decode_sum(payload.payload.view(1, -1), m, spec).double()
        # The all-gather re-quantizes the reduced chunk; the bound adds in the quantizer domain.
        bound[c * m : (c + 1) * m] = rs_bound + rounding_bound(acc, spec)
    return out[:numel], bound


def check_two_phase(rank, ws, spec, numel, dtype, op, *, step=STEP):
    xs = [rank_tensor(j, numel, dtype=dtype, seed=step) for j in range(ws)]
    t = xs[rank].clone()
    stats = CommStats()
    with count_dist_bytes() as sent:
        two_phase_all_reduce(t, spec=spec, op=op, seed=SEED, step=step, stats=stats)
    wire = two_phase_all_reduce_wire_bytes(numel, ws, spec)
    assert sent.total_bytes == stats.total_bytes  # every byte that crossed, counted
    assert stats["two_phase_all_reduce"].bytes == wire
    assert_same_on_all_ranks(t)
    expect, bound = emulate(xs, spec, op, step=step)
    assert torch.equal(t, expect.to(dtype)), "output differs from the two phases' bytes"
    exact = sum(x.double() for x in xs)
    mag = sum(x.double().abs() for x in xs)
    if op == "avg":
        exact, mag = exact / ws, mag / ws
    m = -(-numel // ws)
    # Each chunk is rotated from its own start: check chunk by chunk, the zero pad included.
    err = _pad(t.double() - exact, ws * m)
    slack = _pad(dtype_slack(mag, dtype, spec), ws * m) * 2
    for c in range(ws):
        sl = slice(c * m, (c + 1) * m)
        assert_within(
            err[sl],
            bound[sl],
            spec,
            slack=slack[sl],
            what=f"two_phase {spec} n={numel} {dtype} op={op} chunk {c}",
        )
    return t


def _pad(v: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat((v, v.new_zeros(n - v.numel())))


def _worker(rank, ws):
    for spec in SPECS:
        for numel in LENGTHS:
            check_two_phase(rank, ws, spec, numel, torch.float32, "avg")
        check_two_phase(rank, ws, spec, 301, torch.bfloat16, "avg")
        check_two_phase(rank, ws, spec, 301, torch.float32, "sum")
    # async: the reduce-scatter completes before the call returns, the all-gather on wait().
    sync = check_two_phase(rank, ws, SPECS[0], 400, torch.float32, "avg")
    t = rank_tensor(rank, 400, seed=STEP)
    work = two_phase_all_reduce(t, spec=SPECS[0], seed=SEED, step=STEP, async_op=True)
    work.wait()
    assert work.is_completed() and torch.equal(t, sync)
    _check_bytes_ratio(rank, ws)
    _check_unbiased(rank, ws)


def _check_bytes_ratio(rank, ws):
    numel = 64 * 1024
    with count_dist_bytes() as plain:
        dist.all_reduce(rank_tensor(rank, numel))
    for spec in SPECS:
        with count_dist_bytes() as quant:
            two_phase_all_reduce(rank_tensor(rank, numel), spec=spec)
        factor = (spec.bits / 8 + spec.scale_bytes / spec.group_size) / 4
        # numel / ws elements a chunk, padded up to whole chunks: one group of slack per chunk.
        slack = ws * (spec.scale_bytes + math.ceil(spec.bits / 8))
        sent = quant.total_bytes - quant.bytes.get("all_reduce", 0)  # less the NaN verdicts
        assert quant.calls.get("all_reduce", 0) == 2  # one verdict per phase (raise mode)
        assert sent <= plain.total_bytes * factor + slack, spec


def _check_unbiased(rank, ws):
    m, k = 160, 48
    spec = SPECS[0]
    xs = [rank_tensor(j, m) for j in range(ws)]
    exact = sum(x.double() for x in xs) / ws
    errs = torch.empty(k, m, dtype=torch.float64)
    for s in range(k):
        t = xs[rank].clone()
        two_phase_all_reduce(t, spec=spec, step=s)
        errs[s] = t.double() - exact
    _, bound = emulate(xs, spec, "avg", step=0)
    assert mean_error_ok(errs, bound[:m])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_two_phase_all_reduce(world_size):
    run_distributed(_worker, world_size)


def _feedback(rank: int, world: int) -> list[tuple[float, float, float]]:
    from qsdp.comm import Split

    g = torch.Generator().manual_seed(100 + rank)
    spec = QuantSpec(bits=4, group_size=64, scheme="minmax", rounding="stochastic")
    split = Split(chunk=301, runs=((0, 10, False), (10, 200, True), (210, 91, False)))
    out = []
    for layout, op, dtype in (
        (None, "avg", torch.float32),
        (split, "sum", torch.float32),
        (None, "sum", torch.bfloat16),
        (split, "avg", torch.bfloat16),
    ):
        div = world if op == "avg" else 1
        fb = torch.zeros(301)
        sent, exact = torch.zeros(301, dtype=torch.float64), torch.zeros(301, dtype=torch.float64)
        worst_call = 0.0
        for step in range(6):  # EF-SGD: each call's input carries the last call's feedback
            x = torch.randn(301, generator=g)
            t = (x + fb).to(dtype)
            given = t.double()
            dist.all_reduce(given)
            fb = torch.empty(301)
            two_phase_all_reduce(t, spec=spec, split=layout, op=op, feedback=fb, step=step)
            assert_same_on_all_ranks(t)
            owed = fb.double()
            dist.all_reduce(owed)
            # one call: the result's error is exactly the ranks' feedback, averaged (or summed)
            worst_call = max(worst_call, float((t.double() + owed / div - given / div).abs().max()))
            if layout is not None and dtype == torch.float32:  # raw ones travel exact
                assert float(fb[:10].abs().max()) == 0 and float(fb[210:].abs().max()) == 0
            mean = x.double()
            dist.all_reduce(mean)
            exact += mean / div
            sent += t.double()
        # fp32: over the calls the results telescope to the exact sums minus the last debt
        telescoped = float((sent + owed / div - exact).abs().max())
        out.append(
            (worst_call, telescoped if dtype == torch.float32 else 0.0, float(fb.abs().max()))
        )
    return out


def test_error_feedback_is_exact_over_both_phases():
    # [Note: exact error feedback]: 3 ranks (odd), 301 elements (padded chunks), a split with
    # raw runs, avg and sum, fp32 and bf16 inputs; the feedback is what the encodes that ran lost
    for rows in run_distributed(_feedback, 3):
        for worst_call, telescoped, owed in rows:
            assert worst_call < 2e-5 and telescoped < 5e-5, rows
            assert owed > 0.01, rows  # something was owed


def _second_group(rank: int, world: int) -> str:
    from qsdp.comm import Split

    spec = QuantSpec(bits=4, group_size=64, scheme="minmax", rounding="stochastic")
    split = Split(chunk=301, runs=((0, 10, False), (10, 200, True), (210, 91, False)))
    second = dist.new_group(list(range(world)))
    x = torch.randn(301, generator=torch.Generator().manual_seed(7 + rank))
    import qsdp.comm._common as common

    calls: list[tuple[str, object]] = []  # (collective, group) of every exchange
    real = {"all_gather": common.all_gather, "all_to_all": common.all_to_all}
    common.all_gather = lambda *a, **k: calls.append(("ag", a[2])) or real["all_gather"](*a, **k)
    common.all_to_all = lambda *a, **k: calls.append(("a2a", a[4])) or real["all_to_all"](*a, **k)
    for layout in (None, split):
        runs = {}
        for label, gather in (("one", None), ("two", second)):
            calls.clear()
            t, fb, stats = x.clone(), torch.empty(301), qc.CommStats()
            work = two_phase_all_reduce(
                t,
                spec=spec,
                split=layout,
                feedback=fb,
                step=3,
                stats=stats,
                async_op=True,
                second_group=gather,
            )
            work.wait()
            runs[label] = (t, fb, stats.total_bytes)
            world_pg = dist.group.WORLD
            assert [(c, g or world_pg) for c, g in calls] == [
                ("a2a", world_pg),
                ("ag", gather or world_pg),  # phase 2 on the second communicator when given
            ], calls
        # [Note: two communicators]: the same bits, the same bytes, on every rank
        assert torch.equal(runs["one"][0], runs["two"][0]), layout
        assert torch.equal(runs["one"][1], runs["two"][1]), layout
        assert runs["one"][2] == runs["two"][2] > 0, layout
        assert_same_on_all_ranks(runs["two"][0])
    # a second group over other ranks is refused on every rank of the call, before any exchange
    # (the next call's collectives still match): ranks 0 and 1 reduce over their pair, with the
    # world as the second group
    pair = dist.new_group([0, 1])
    message = ""
    if rank < 2:
        try:
            two_phase_all_reduce(x.clone(), pair, spec=spec, second_group=dist.group.WORLD)
        except ValueError as e:
            message = str(e)
    t = x.clone()
    two_phase_all_reduce(t, spec=spec, second_group=second)
    assert_same_on_all_ranks(t)
    common.all_gather, common.all_to_all = real["all_gather"], real["all_to_all"]
    return message


def test_a_second_communicator_for_phase_two_changes_nothing_but_the_queue():
    messages = run_distributed(_second_group, 3)
    assert messages[2] == ""  # (not in the pair)
    for m in messages[:2]:
        assert "second_group holds the ranks [0, 1, 2], the all-reduce's group [0, 1]" in m, m
