"""Collectives that carry a policy split: the compressed part is exactly the collective on it
alone, the raw part exactly the plain collective, the bytes those of ``*_wire_bytes(split=)``,
and ``get_future()`` yields the result (what DDP hooks return)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import qsdp.comm as qc
from qsdp.comm import CommStats, Split
from qsdp.quant import QuantSpec
from qsdp.testing import count_dist_bytes, rank_tensor, run_distributed

SPEC = QuantSpec(bits=4, group_size=32, scheme="minmax", rounding="stochastic")
KEY = dict(seed=3, step=5, bucket=2)
M = 97  # elements per chunk: odd
SPLIT = Split(chunk=M, runs=((0, 10, False), (10, 60, True), (70, 3, False), (73, 24, True)))


def _gather_all(x: torch.Tensor) -> torch.Tensor:
    rows = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype)
    qc_all = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    qc_all(rows, x.contiguous())
    return rows.view(dist.get_world_size(), -1)


def _check(name, got, comp_ref, raw_exact, stats, sent, wire):
    n = dist.get_world_size()
    comp, raw = SPLIT.take(got.view(-1, M))
    assert torch.equal(comp.reshape(-1), comp_ref.reshape(-1)), f"{name}: codes part differs"
    # float32 sums of a few terms: within a few ulps of the exact (float64) sum
    torch.testing.assert_close(
        raw.reshape(-1).double(), raw_exact.reshape(-1), rtol=1e-5, atol=1e-6
    )
    key = name
    assert stats[key].bytes == wire, (name, stats[key].bytes, wire)
    assert sent.total_bytes == stats.total_bytes, name
    del n


def _worker(rank: int, world: int) -> None:
    n = world
    x = rank_tensor(rank, n * M, seed=1)
    everyone = _gather_all(x)  # [n, n * M]: every rank's input, for the exact raw sums
    _, raw_all = SPLIT.take(everyone.view(n * n, M))
    raw_all = raw_all.view(n, n, -1).double()  # [sender, chunk, raw]

    # reduce-scatter: codes and raw bytes in one all-to-all
    comp_in, _ = SPLIT.take(x.view(n, M))
    ref = torch.empty(SPLIT.n_comp)
    qc.reduce_scatter(ref, comp_in.reshape(-1), spec=SPEC, stats=CommStats(), **KEY)
    out, stats = torch.empty(M), CommStats()
    with count_dist_bytes() as sent:
        work = qc.reduce_scatter(out, x, spec=SPEC, split=SPLIT, stats=stats, async_op=True, **KEY)
        assert work.get_future().wait() is out
    wire = qc.reduce_scatter_wire_bytes(n * M, n, SPEC, split=SPLIT)
    _check("reduce_scatter", out, ref, raw_all[:, rank].sum(0) / n, stats, sent, wire)
    assert sent.calls.get("all_to_all_single", 0) == (1 if n > 1 else 0)

    # all-gather: [codes | raw] rows in one all-gather, in place (FSDP's aliasing layout)
    shard = x[:M].clone()
    comp_in, _ = SPLIT.take(shard.view(1, M))
    ref = torch.empty(n * SPLIT.n_comp)
    qc.all_gather(ref, comp_in.reshape(-1), spec=SPEC, stats=CommStats(), **KEY)
    out, stats = torch.empty(n * M), CommStats()
    out.view(n, M)[rank].copy_(shard)
    with count_dist_bytes() as sent:
        qc.all_gather(out, out.view(n, M)[rank], spec=SPEC, split=SPLIT, stats=stats, **KEY)
    _, raw_shards = SPLIT.take(everyone[:, :M])
    wire = qc.all_gather_wire_bytes(M, SPEC, split=SPLIT)
    _check("all_gather", out, ref, raw_shards.double(), stats, sent, wire)

    # integer reduce-scatter: the raw part in a second, plain reduce-scatter
    comp_in, _ = SPLIT.take(x.view(n, M))
    ref = torch.empty(SPLIT.n_comp)
    qc.integer_reduce_scatter(ref, comp_in.reshape(-1), stats=CommStats(), **KEY)
    out, stats = torch.empty(M), CommStats()
    with count_dist_bytes() as sent:
        qc.integer_reduce_scatter(out, x, split=SPLIT, stats=stats, **KEY)
    wire = qc.integer_reduce_scatter_wire_bytes(n * M, n, split=SPLIT)
    _check("integer_reduce_scatter", out, ref, raw_all[:, rank].sum(0) / n, stats, sent, wire)

    # all-reduces (DDP's and HSDP's): integer and two-phase, raw part in a plain all-reduce
    t = x[:M].clone()
    comp_in, _ = SPLIT.take(t.view(1, M))
    raw_sum = raw_shards.double().sum(0) / n
    for name, call, wire in (
        (
            "integer_all_reduce",
            lambda v, **kw: qc.integer_all_reduce(v, **kw),
            qc.integer_all_reduce_wire_bytes(M, split=SPLIT),
        ),
        (
            "two_phase_all_reduce",
            lambda v, **kw: qc.two_phase_all_reduce(v, spec=SPEC, **kw),
            qc.two_phase_all_reduce_wire_bytes(M, n, SPEC, split=SPLIT),
        ),
    ):
        ref = comp_in.reshape(-1).clone()
        call(ref, stats=CommStats(), **KEY)
        out, stats = t.clone(), CommStats()
        with count_dist_bytes() as sent:
            work = call(out, split=SPLIT, stats=stats, async_op=True, **KEY)
            assert work.get_future().wait() is out
        _check(name, out, ref, raw_sum, stats, sent, wire)
        if name == "two_phase_all_reduce":  # the raw part rides in the two phases' calls
            # two all-reduces: each phase's NaN/Inf verdict; none for the raw part
            assert sent.calls.get("all_reduce", 0) == 2, sent.calls
            assert sent.calls.get("all_to_all_single", 0) == (1 if n > 1 else 0), sent.calls


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_carry_a_split(world):
    run_distributed(_worker, world)


def _two_level(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    intra = QuantSpec(bits=8, group_size=32, scheme="absmax", rounding="stochastic")
    inter = QuantSpec(bits=4, group_size=32, scheme="absmax", rounding="stochastic")
    x = rank_tensor(rank, world * M, seed=2)
    everyone = _gather_all(x)
    _, raw_all = SPLIT.take(everyone.view(world * world, M))
    raw_all = raw_all.view(world, world, -1).double()
    comp_in, _ = SPLIT.take(x.view(world, M))
    args = dict(mesh=mesh, intra_spec=intra, inter_spec=inter, pipeline=2, **KEY)
    ref = torch.empty(SPLIT.n_comp)
    qc.hierarchical_reduce_scatter(ref, comp_in.reshape(-1), stats=CommStats(), **args)
    out, stats = torch.empty(M), CommStats()
    with count_dist_bytes() as sent:
        qc.hierarchical_reduce_scatter(out, x, split=SPLIT, stats=stats, **args)
    wire = qc.hierarchical_reduce_scatter_wire_bytes(
        world * M, 2, 2, intra, inter, pipeline=2, split=SPLIT
    )
    _check(
        "hierarchical_reduce_scatter", out, ref, raw_all[:, rank].sum(0) / world, stats, sent, wire
    )


def test_two_level_carries_a_split():
    run_distributed(_two_level, 4)


def test_split_validates():
    with pytest.raises(ValueError, match="cover"):
        Split(chunk=5, runs=((0, 3, True),))
    with pytest.raises(ValueError, match="in order"):
        Split(chunk=5, runs=((0, 3, True), (4, 1, False)))


def _wrong_split(rank: int, world: int) -> None:
    x = torch.randn(world * (M + 1))
    calls = {
        "reduce_scatter": lambda: qc.reduce_scatter(torch.empty(M + 1), x, spec=SPEC, split=SPLIT),
        "all_gather": lambda: qc.all_gather(torch.empty(M + 1), x, spec=SPEC, split=SPLIT),
        "integer_reduce_scatter": lambda: qc.integer_reduce_scatter(
            torch.empty(M + 1), x, split=SPLIT
        ),
        "integer_all_reduce": lambda: qc.integer_all_reduce(x.clone(), split=SPLIT),
        "two_phase_all_reduce": lambda: qc.two_phase_all_reduce(x.clone(), spec=SPEC, split=SPLIT),
    }
    for name, call in calls.items():  # refused before any communication
        with pytest.raises(ValueError, match=f"covers {M} elements, but .* has {M + 1}"):
            call()
            pytest.fail(f"{name} accepted a split of another chunk")


def test_a_split_of_another_chunk_is_refused():
    run_distributed(_wrong_split, 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_two_phase_rows_layout(n):
    """The two-phase all-reduce's ``[mc compressed | mr raw]`` rows, filled piece by piece from
    the split's runs, equal the parts padded and stacked (and map back exactly)."""
    from qsdp.comm._two_phase import _chunked

    g = torch.Generator().manual_seed(n)
    for _ in range(20):
        lengths = torch.randint(1, 40, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        runs, at, kind = [], 0, bool(torch.randint(0, 2, (1,), generator=g))
        for length in lengths.tolist():
            runs.append((at, length, kind))
            at, kind = at + length, not kind
        split = Split(chunk=at, runs=tuple(runs))
        x = torch.randn(at, generator=g)
        per_chunk, pieces = _chunked(split, n)
        mc, mr = per_chunk.n_comp, per_chunk.n_raw
        assert (mc, mr) == (-(-split.n_comp // n), -(-split.n_raw // n))
        rows = torch.zeros(n * (mc + mr))
        sources, targets = pieces.views(x, rows)
        assert sum(t.numel() for t in sources) == at  # every element of x, once
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
        comp, raw = split.take(x.view(1, -1))
        want = torch.cat(
            [
                torch.cat([comp.view(-1), torch.zeros(n * mc - split.n_comp)]).view(n, mc),
                torch.cat([raw.view(-1), torch.zeros(n * mr - split.n_raw)]).view(n, mr),
            ],
            dim=1,
        )
        assert torch.equal(rows.view(n, mc + mr), want), (split, n)
        back = torch.full_like(x, float("nan"))
        torch._foreach_copy_(*pieces.views(back, rows))
        assert torch.equal(back, x)
        # no piece crosses a row's part: each lies within its row's compressed or raw columns
        for t in targets:
            d, k = t.storage_offset(), t.numel()
            assert k <= (mc if d % (mc + mr) < mc else mr) and (d % (mc + mr) < mc) == (
                (d + k - 1) % (mc + mr) < mc
            )


def test_views_equal_take_and_copy_nothing_when_one_run_each():
    rows = torch.randn(3, M)
    for split, shared in (
        (SPLIT, False),
        (Split(chunk=M, runs=((0, 90, True), (90, 7, False))), True),
        (Split(chunk=M, runs=((0, M, True),)), True),
        (Split(chunk=M, runs=((0, M, False),)), True),
    ):
        assert split.one_run_each == shared
        for got, want in zip(split.views(rows), split.take(rows), strict=True):
            assert torch.equal(got, want)
            if shared and got.numel():
                assert got.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
