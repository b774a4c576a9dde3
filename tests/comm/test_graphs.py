"""reduce_scatter, all_gather, all_gather_diff and two_phase_all_reduce with graphs=...: the
captured segments' buffers and keys give the eager call's bits ([Note: codec segments
replayed]). On CPU the segments run eagerly on their persistent buffers
(``CodecGraphs(capture=False)``, the Triton kernels interpreted) and the eager calls on the torch
reference; the capture and replay themselves are the GPU tier's (``test_graphs_gpu.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from qsdp.comm import (
    CodecGraphs,
    CommStats,
    Split,
    all_gather,
    all_gather_diff,
    hierarchical_reduce_scatter,
    reduce_scatter,
    two_phase_all_reduce,
)
from qsdp.quant import QuantSpec
from qsdp.testing import assert_same_on_all_ranks, rank_tensor, run_distributed

SPEC = QuantSpec(
    bits=4,
    group_size=64,
    scheme="absmax",
    rounding="stochastic",
    hadamard_block=32,
    hadamard_seed=5,
    nonfinite="propagate",
)
M = 97  # elements per destination chunk: not a multiple of the group size
#: (step, bucket) of each call: two steps of a site (bucket 1: the step word read anew), then a
#: second site of the same shape (bucket 2: the buffers shared, its own noise)
CALLS = ((0, 1), (1, 1), (1, 2))

# (captured, replayed) over CALLS, what a capture makes (and CodecGraphs(capture=False) counts:
# the GPU tier asserts the same of its captures). A reduce-scatter: its encode per site (2), its
# decode per shape (1), of 3 calls x 2 segments; an all-gather: an encode and a decode for each
# of its two shapes (bucket 1 into float32, bucket 2 in place in bf16), of 6 runs.
RS_PER_SPLIT, AG_PER_SPLIT = (3, 3), (4, 2)
#: the weight-difference gathers: two sites (reconstructions) of one shape, each 3 difference
#: calls of 5 (two exact): an encode and a decode captured at the first; sites; buffer sets
DIFF_COUNTS = (4, 8, 2, 1)
#: CGX's two phases, 5 cases x 2 buckets: phase 1's sites (8: the second-group case shares the
#: several-runs case's) an encode each, each pair of sites (10) phase 1's decode and phase 2's
#: encode in one segment, phase 2's decode per shape (5): 23 of 5 x 3 calls x 3 segments;
#: sites: 10 composite, 8 of phase 1, 10 of phase 2
TWO_PHASE_COUNTS = (23, 22, 28)
#: per case of the two-level replays: two levels, an encode and a middle hop per site (2) and a
#: decode per shape of 3 calls x 3 segments; one level, the reduce-scatter's
TWO_LEVEL_PER_CASE = {"two levels": (5, 4), "one level": RS_PER_SPLIT}
SPLITS = {
    "whole": None,
    "one run each": Split.of([(60, True), (37, False)]),
    "several runs": Split(
        chunk=M, runs=((0, 10, False), (10, 60, True), (70, 3, False), (73, 24, True))
    ),
}
#: the two-level cases' splits: also a group whose parameters all travel raw (a root module
#: holding only norms: no codes, the raw reduce-scatter alone)
LEVEL_SPLITS = {**SPLITS, "all raw": Split.of([(M, False)])}


def _reduce(rank, ws, split, step, bucket, graphs, device, backend):
    """One reduce-scatter of this step's and bucket's input: its output and bytes."""
    x = rank_tensor(rank, ws * M, seed=step + 10 * bucket).to(device, torch.bfloat16)
    out, sent = torch.full((M,), float("nan"), device=device), CommStats()
    reduce_scatter(out, x, **_keys(split, step, bucket, backend, sent, graphs))
    return out, sent


def _keys(split, step, bucket, backend, stats, graphs) -> dict:
    """The keyword arguments both collectives take here."""
    return dict(
        spec=SPEC,
        split=split,
        seed=3,
        step=step,
        bucket=bucket,
        backend=backend,
        stats=stats,
        graphs=graphs,
    )


def _gather(rank, ws, split, step, bucket, graphs, device, backend):
    """One all-gather; bucket 2 in FSDP2's in-place layout (a bf16 output whose row ``rank``
    is the input), bucket 1 into a float32 output."""
    x = rank_tensor(rank, M, seed=step + 10 * bucket).to(device, torch.bfloat16)
    dtype = torch.bfloat16 if bucket == 2 else torch.float32
    out, sent = torch.full((ws * M,), float("nan"), device=device, dtype=dtype), CommStats()
    inp = x
    if bucket == 2:
        inp = out.view(ws, M)[rank]
        inp.copy_(x)
    all_gather(out, inp, **_keys(split, step, bucket, backend, sent, graphs))
    return out, sent


def _eager(device: str) -> str:
    """The eager calls' backend: on the CPU the torch reference, the Triton kernels' bits (the
    quantizer's parity tests) in a fraction of the interpreter's time, so a replay is checked
    against the other implementation too; on a GPU the kernels the replays captured."""
    return "reference" if device == "cpu" else "auto"


def _named(split: Split | None) -> Split | None:
    """``split`` as another group of equal blocks has it: equal, the parameters named anew (the
    two groups share one set of buffers)."""
    return None if split is None else dataclasses.replace(split, raw_names=("blocks.1.ln",))


def _matches_eager(rank, ws, call, shapes, device, capture, splits):
    """Per split of ``splits`` (names in :data:`SPLITS`), the calls of :data:`CALLS` (two
    sites: two groups of equal blocks, bucket 2's split naming its parameters anew): each
    replayed call's output and bytes are the eager call's (each step its own noise);
    ``shapes`` sets of buffers per split."""
    graphs = CodecGraphs(capture=capture)
    backend = "triton" if device == "cpu" else "auto"
    for name in splits:
        first = SPLITS[name]
        for step, bucket in CALLS:
            split = first if bucket == 1 else _named(first)
            eager, sent = call(rank, ws, split, step, bucket, None, device, _eager(device))
            got, sent_replayed = call(rank, ws, split, step, bucket, graphs, device, backend)
            assert torch.equal(eager, got), (name, step, bucket)
            assert sent.snapshot() == sent_replayed.snapshot(), name
            assert ws == 1 or sent.total_bytes > 0
            assert_same_on_all_ranks(torch.tensor([step, bucket], device=device))
    assert len(graphs._buffers) == shapes * len(splits)
    return graphs.captured, graphs.replayed


def replay_matches_eager(rank, ws, *, device="cpu", capture=False, splits=tuple(SPLITS)):
    """The reduce-scatter's replays; its two buckets share one set of buffers."""
    return _matches_eager(rank, ws, _reduce, 1, device, capture, splits)


def gather_replay_matches_eager(rank, ws, *, device="cpu", capture=False, splits=tuple(SPLITS)):
    """The all-gather's replays (two shapes: the float32 and the in-place bf16 output)."""
    return _matches_eager(rank, ws, _gather, 2, device, capture, splits)


#: SDP4Bit's weight differences (4 bits, no rotation), as the recipe's gathers send them
DIFF_SPEC = QuantSpec(
    bits=4, group_size=64, scheme="absmax", rounding="stochastic", nonfinite="propagate"
)


def diff_replay_matches_eager(rank, ws, *, device="cpu", capture=False):
    """Two groups' weight-difference gathers (two reconstructions, one shape): five calls
    each, exact at 0 and 3 (the first, a resync: eager), call 2 a gather ahead (no output),
    bucket 2 in FSDP2's in-place layout; every reconstruction, output and byte count the
    eager call's. Returns (captured, replayed, sites, buffer sets)."""
    graphs = CodecGraphs(capture=capture)
    backend = "triton" if device == "cpu" else "auto"
    for bucket in (1, 2):
        recon = {g: torch.zeros(ws * M, dtype=torch.bfloat16, device=device) for g in (0, 1)}
        for step in range(5):
            x = rank_tensor(rank, M, seed=step + 10 * bucket).to(device, torch.bfloat16)
            outs, sent = [], []
            for g in (0, 1):
                out = torch.full((ws * M,), float("nan"), dtype=torch.bfloat16, device=device)
                inp = x
                if bucket == 2:
                    inp = out.view(ws, M)[rank]
                    inp.copy_(x)
                sent.append(CommStats())
                all_gather_diff(
                    None if step == 2 else out,
                    inp,
                    recon[g],
                    spec=DIFF_SPEC,
                    exact=step in (0, 3),
                    seed=3,
                    step=step,
                    bucket=bucket,
                    backend=backend if g else _eager(device),
                    stats=sent[-1],
                    graphs=graphs if g else None,
                )
                outs.append(out)
            assert torch.equal(recon[0], recon[1]), (step, bucket)
            assert torch.equal(outs[0], outs[1]) or step == 2, (step, bucket)
            assert step == 2 or torch.equal(outs[1], recon[1]), (step, bucket)
            assert sent[0].snapshot() == sent[1].snapshot(), (step, bucket)
            assert not torch.isnan(recon[1]).any()
            assert_same_on_all_ranks(recon[1])  # the reconstruction every rank holds
    return graphs.captured, graphs.replayed, len(graphs.sites), len(graphs._buffers)


@pytest.mark.parametrize("world_size", [1, 3])
def test_replayed_buffers_give_the_eager_bits(world_size):
    # (one rank: no peers, each split's own chunk alone; one split of several runs shows it)
    splits = tuple(SPLITS) if world_size > 1 else ("several runs",)
    k = len(splits)
    got = run_distributed(replay_matches_eager, world_size, splits=splits)
    assert got == [(RS_PER_SPLIT[0] * k, RS_PER_SPLIT[1] * k)] * world_size
    got = run_distributed(gather_replay_matches_eager, world_size, splits=splits)
    assert got == [(AG_PER_SPLIT[0] * k, AG_PER_SPLIT[1] * k)] * world_size
    # (each group's own reconstruction: a site each; one set of buffers for their shape)
    assert run_distributed(diff_replay_matches_eager, world_size) == [DIFF_COUNTS] * world_size


def two_phase_replay_matches_eager(rank, ws, *, device="cpu", capture=False):
    """CGX's two-phase all-reduce replayed ([Note: two phases replayed]): DDP buckets of an odd
    length (padded inside to whole chunks) and of a whole number of chunks, raw runs beside the
    codes, phase 2 on a second communicator; the calls of :data:`CALLS` for each, every
    result and byte count the eager call's. Returns (captured, replayed, sites)."""
    graphs = CodecGraphs(capture=capture)
    backend = "triton" if device == "cpu" else "auto"
    eager = _eager(device)
    second = dist.new_group(list(range(ws)))
    cases = [("padded", M, None, None), ("whole chunks", 12 * ws, None, None)]
    cases += [(name, M, split, None) for name, split in SPLITS.items() if split is not None]
    cases.append(("second group", M, SPLITS["several runs"], second))
    for name, numel, split, group2 in cases:
        for step, bucket in CALLS:
            x = rank_tensor(rank, numel, seed=step + 10 * bucket).to(device, torch.bfloat16)
            got, sent = {}, {}
            for way, g, kernels in (("eager", None, eager), ("replayed", graphs, backend)):
                got[way], sent[way] = x.clone(), CommStats()
                keys = _keys(split, step, bucket, kernels, sent[way], g)
                two_phase_all_reduce(got[way], second_group=group2, **keys)
            assert torch.equal(got["eager"], got["replayed"]), (name, step, bucket)
            assert sent["eager"].snapshot() == sent["replayed"].snapshot(), name
            assert ws == 1 or sent["eager"].total_bytes > 0
            assert not torch.equal(got["replayed"], x) or ws == 1  # (it reduced)
            assert_same_on_all_ranks(got["replayed"])
    # the rows a call copies into: one per shape (both buckets of a case share them), none for
    # whole chunks without a split (the tensor is phase 1's input and phase 2's output)
    direct = sum(1 for _, numel, split, _ in cases if split is None and numel % ws == 0)
    assert direct == (2 if ws == 1 else 1)
    assert sum(1 for key in graphs._buffers if key[0] == "two_phase rows") == len(cases) - direct
    return graphs.captured, graphs.replayed, len(graphs.sites)


@pytest.mark.parametrize("world_size", [1, 3])
def test_two_phase_replays_give_the_eager_bits(world_size):
    # each case's two buckets: a composite site each (10), with a phase-2 site each (10) and
    # phase-1 sites (8: the second-group case's are the several-runs case's, same key)
    got = run_distributed(two_phase_replay_matches_eager, world_size)
    assert got == [TWO_PHASE_COUNTS] * world_size


def two_level_replay_matches_eager(rank, ws, cases, *, device="cpu", capture=False):
    """SDP4Bit's two-level reduce-scatter replayed ([Note: two levels replayed]): for each
    case (a mesh's rank lists, one level where a dimension is 1, and a split), two steps of one
    bucket and a second bucket (another site, the same buffers, reporting the node average as
    staleness 1 asks), every result, node average and byte count the eager call's. Returns
    (captured, replayed, sites, buffer sets)."""
    from torch.distributed.device_mesh import DeviceMesh

    graphs = CodecGraphs(capture=capture)
    backend = "triton" if device == "cpu" else "auto"
    intra = dataclasses.replace(SPEC, bits=8)
    for rows, name in cases:
        mesh = DeviceMesh(device, rows, mesh_dim_names=("inter", "intra"))
        for step, bucket in CALLS:
            x = rank_tensor(rank, ws * M, seed=step + 10 * bucket).to(device, torch.bfloat16)
            got, sent, average = {}, {}, {}
            for way, g, kernels in (("eager", None, _eager(device)), ("replayed", graphs, backend)):
                got[way], sent[way] = torch.full((M,), float("nan"), device=device), CommStats()
                node = {}
                if bucket == 2:
                    node["node_average"] = lambda t, w=way, a=average: a.setdefault(w, t.clone())
                hierarchical_reduce_scatter(
                    got[way],
                    x,
                    mesh=mesh,
                    intra_spec=intra,
                    inter_spec=SPEC,
                    split=LEVEL_SPLITS[name] if bucket == 1 else _named(LEVEL_SPLITS[name]),
                    seed=3,
                    step=step,
                    bucket=bucket,
                    backend=kernels,
                    stats=sent[way],
                    graphs=g,
                    **node,
                )
            what = (rows, name, step, bucket)
            assert torch.equal(got["eager"], got["replayed"]), what
            assert len(average) == 2 * (bucket == 2), what
            if average:
                assert average["eager"].dtype == average["replayed"].dtype == torch.float32
                assert torch.equal(average["eager"], average["replayed"]), what
            assert sent["eager"].snapshot() == sent["replayed"].snapshot(), what
            assert sent["eager"].total_bytes > 0
            assert not torch.isnan(got["replayed"]).any()
            assert_same_on_all_ranks(torch.tensor([step, bucket], device=device))
    return graphs.captured, graphs.replayed, len(graphs.sites), len(graphs._buffers)


@pytest.mark.parametrize(
    ("world_size", "cases"),
    [
        # row-major; listed in another order (a column's rows not evenly spaced; three nodes
        # and the own column's encodes around the own chunk: test_hierarchical.py); one level;
        # a group of raw parameters only (norms: no codes, the raw reduce-scatter alone)
        (4, [([[0, 1], [2, 3]], "whole"), ([[3, 1], [2, 0]], "several runs"),
             ([[0, 1, 2, 3]], "one run each"), ([[0, 1], [2, 3]], "all raw")]),
    ],
    ids=["2x2,1x4"],
)  # fmt: skip
def test_two_level_replays_give_the_eager_bits(world_size, cases):
    got = run_distributed(two_level_replay_matches_eager, world_size, cases)
    # a site per case and bucket; a set of buffers per case (its mesh and split: its shape)
    counts = two_level_counts(cases)
    assert got == [(*counts, 2 * len(cases), len(cases))] * world_size


def two_level_counts(cases) -> tuple[int, int]:
    """(captured, replayed) of the two-level replay cases (``TWO_LEVEL_PER_CASE``)."""
    per = [TWO_LEVEL_PER_CASE["one level" if len(rows) == 1 else "two levels"] for rows, _ in cases]
    return sum(c for c, _ in per), sum(r for _, r in per)


def _refusals(rank, ws):
    graphs = CodecGraphs(capture=False)
    x, out = torch.randn(ws * 8), torch.empty(8)
    with pytest.raises(ValueError, match="a synchronous call"):
        reduce_scatter(out, x, spec=SPEC, async_op=True, graphs=graphs, backend="triton")
    with pytest.raises(ValueError, match="nonfinite='propagate'"):
        reduce_scatter(
            out,
            x,
            spec=dataclasses.replace(SPEC, nonfinite="raise"),
            graphs=graphs,
            backend="triton",
        )
    with pytest.raises(ValueError, match="CUDA tensors"):
        reduce_scatter(out, x, spec=SPEC, graphs=CodecGraphs(), backend="triton")
    with pytest.raises(ValueError, match="not divisible"):
        reduce_scatter(out, torch.randn(ws * 8 + 1), spec=SPEC, graphs=graphs, backend="triton")
    with pytest.raises(ValueError, match="error feedback's losses"):
        two_phase_all_reduce(
            x.clone(), spec=SPEC, feedback=torch.empty(ws * 8), graphs=graphs, backend="triton"
        )
    with pytest.raises(ValueError, match="a synchronous call"):
        two_phase_all_reduce(x.clone(), spec=SPEC, async_op=True, graphs=graphs, backend="triton")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [[0], [1]], mesh_dim_names=("inter", "intra"))
    levels = dict(mesh=mesh, intra_spec=SPEC, inter_spec=SPEC, graphs=graphs, backend="triton")
    with pytest.raises(ValueError, match="replays the hops of one piece; got pipeline=2"):
        hierarchical_reduce_scatter(out, x, **levels, pipeline=2)
    with pytest.raises(ValueError, match="a synchronous call"):
        hierarchical_reduce_scatter(out, x, **levels, async_op=True)
    return True


def test_replay_refuses_what_it_cannot_capture():
    assert all(run_distributed(_refusals, 2))


def _installs(rank, ws):
    """What ``compress_fsdp(schedule=Schedule(graphs=True))`` refuses, on every rank."""
    from torch.distributed.fsdp import fully_shard

    import qsdp
    from tests.models import classifier

    got = {}
    for name, config in (("cpu", "qsdp-w8g8"), ("integer", "global-qsgd"), ("auto", "auto")):
        torch.manual_seed(0)  # two equal modules: what graphs=True replays (a twin each)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)
        )
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        try:
            qsdp.compress_fsdp(model, config, schedule=qsdp.Schedule(graphs=True))
            got[name] = "accepted"
        except ValueError as e:
            got[name] = str(e)
    for name, config, feedback in (
        ("ddp cpu", "cgx", False),
        ("ddp integer", "global-qsgd", False),
        ("ddp auto", "auto", False),
        ("ddp feedback", "cgx", True),
        ("ddp stale", "cgx", False),
    ):
        ddp = torch.nn.parallel.DistributedDataParallel(classifier())
        schedule = qsdp.Schedule(graphs=True, staleness=int(name == "ddp stale"))
        try:
            qsdp.ddp.register(ddp, config, schedule=schedule, error_feedback=feedback)
            got[name] = "accepted"
        except ValueError as e:
            got[name] = str(e)
    return got


def test_graphs_are_refused_where_there_is_nothing_to_replay():
    import qsdp

    for got in run_distributed(_installs, 2):
        assert "parameters are on ['cpu']: drop graphs off CUDA" in got["cpu"], got
        assert "reduces with IntegerReduce" in got["integer"], got
        assert "pass the recipe it reports" in got["auto"], got
        assert "parameters are on ['cpu']: drop graphs off CUDA" in got["ddp cpu"], got
        assert "global-qsgd (IntegerGrads) has none to replay" in got["ddp integer"], got
        assert "'auto' has none to replay" in got["ddp auto"], got
        assert "error feedback's losses are computed eagerly" in got["ddp feedback"], got
        assert "Schedule(graphs=True, staleness=1) under DDP" in got["ddp stale"], got
    assert qsdp.Schedule(graphs=True, staleness=1).graphs  # (FSDP2 replays its delayed ones)
    with pytest.raises(TypeError, match="must be a bool"):
        qsdp.Schedule(graphs=1)
