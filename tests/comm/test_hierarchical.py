"""SDP4Bit's two-level reduce-scatter on gloo device meshes 2x2, 3x2 and the degenerate 1xB, Ax1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from qsdp.comm import CommStats, hierarchical_reduce_scatter, hierarchical_reduce_scatter_wire_bytes
from qsdp.comm._common import noise_stream
from qsdp.comm._hierarchical import _pieces
from qsdp.comm._mesh_layout import mesh_layout, runs_of
from qsdp.quant import QuantSpec, decode_sum, decode_sum_encode, encode
from qsdp.quant.reference import decode_sum_flat
from qsdp.testing import (
    assert_within,
    count_dist_bytes,
    dtype_slack,
    rank_tensor,
    rounding_bound,
    run_distributed,
    to_quant_domain,
)

from .test_all_gather import mean_error_ok
from .test_reduce_scatter import check_reduce_scatter


def sdp4bit(
    rounding: str, group: int = 64, hadamard: int | None = 32
) -> tuple[QuantSpec, QuantSpec]:
    seed = 9 if hadamard else None
    return tuple(
        QuantSpec(
            bits=b,
            group_size=group,
            scheme="absmax",
            rounding=rounding,
            hadamard_block=hadamard,
            hadamard_seed=seed,
        )
        for b in (8, 4)
    )


SPEC_PAIRS = [sdp4bit("stochastic"), sdp4bit("nearest", hadamard=None), sdp4bit("nearest", 32)]
CHUNKS = [0, 1, 45, 200]  # elements per destination chunk
SEED = 3


def _intra_payload(xs, src, c, m, piece, intra, *, step, bucket) -> torch.Tensor:
    """The bytes rank ``src`` sends at the intra hop for piece ``(p, (o, n))`` of chunk ``c``."""
    p, (o, n) = piece
    return encode(
        xs[src][c * m + o : c * m + o + n],
        intra,
        seed=SEED,
        step=step,
        stream=noise_stream(src, c, bucket=bucket, hop=0, piece=p),
    ).payload


def emulate(xs, na, nb, coord, m, intra, inter, pipeline, *, step, bucket=0):
    """Expected float32 sum of chunk ``a*B+b`` from the bytes each rank would send, and the
    error bound of each hop (quantizer domain)."""
    a, b = coord
    c = a * nb + b
    acc = xs[c][c * m : (c + 1) * m].to(torch.float32, copy=True)
    bound = torch.zeros(m, dtype=torch.float64)
    for j in range(na * nb):
        if j != c:
            bound += rounding_bound(xs[j][c * m : (c + 1) * m], intra)
    peers = [b2 for b2 in range(nb) if b2 != b]
    for piece in enumerate(_pieces(m, intra.group_size, pipeline)):
        p, (o, n) = piece

        def payloads(node: int, locals_: list[int], piece=piece) -> torch.Tensor:
            return torch.stack(
                [
                    _intra_payload(xs, node * nb + b2, c, m, piece, intra, step=step, bucket=bucket)
                    for b2 in locals_
                ]
            )

        decode_sum(payloads(a, peers), n, intra, out=acc[o : o + n], accumulate=True)
        partials = []
        for a2 in range(na):
            if a2 == a:
                continue
            # Rank (a2, b) stacks its peers' payloads in rank order, then its own encode.
            stack = payloads(a2, peers + [b])
            rotated_sum = decode_sum_flat(stack, n, intra, rotate=False)
            bound[o : o + n] += rounding_bound(rotated_sum, inter, rotated=True)
            partials.append(
                decode_sum_encode(
                    stack,
                    n,
                    intra,
                    inter,
                    seed=SEED,
                    step=step,
                    stream=noise_stream(a2 * nb + b, c, bucket=bucket, hop=1, piece=p),
                ).payload
            )
        decode_sum(torch.stack(partials), n, inter, out=acc[o : o + n], accumulate=True)
    return acc, bound


def check_two_level(mesh, specs, m, dtype, op, pipeline, *, step=0):
    intra, inter = specs
    na, nb = mesh.size(0), mesh.size(1)
    ws = na * nb
    a, b = mesh.get_coordinate()
    c = a * nb + b
    assert c == dist.get_rank(), "init_device_mesh lays ranks out row-major"
    xs = [rank_tensor(j, ws * m, dtype=dtype, seed=step) for j in range(ws)]
    out = torch.full((m,), float("nan"), dtype=dtype)
    stats = CommStats()
    with count_dist_bytes() as sent:
        hierarchical_reduce_scatter(
            out,
            xs[c],
            mesh=mesh,
            intra_spec=intra,
            inter_spec=inter,
            op=op,
            pipeline=pipeline,
            seed=SEED,
            step=step,
            stats=stats,
        )
    wire = hierarchical_reduce_scatter_wire_bytes(ws * m, na, nb, intra, inter, pipeline=pipeline)
    assert sent.total_bytes == stats.total_bytes  # every byte that crossed, counted
    assert stats["hierarchical_reduce_scatter"].bytes == wire
    parts = [x[c * m : (c + 1) * m] for x in xs]
    exact = sum(p.double() for p in parts)
    mag = sum(p.double().abs() for p in parts)
    if na > 1 and nb > 1:
        expect, bound = emulate(xs, na, nb, (a, b), m, intra, inter, pipeline, step=step)
        if op == "avg":
            expect /= ws
        assert torch.equal(out, expect.to(dtype)), "output differs from the two-hop emulation"
    else:  # one level: the single-level reduce-scatter with that level's quantizer
        spec = intra if na == 1 else inter
        bound = sum(
            (rounding_bound(p, spec) for j, p in enumerate(parts) if j != c),
            torch.zeros(m, dtype=torch.float64),
        )
    if op == "avg":
        exact, bound, mag = exact / ws, bound / ws, mag / ws
    assert_within(
        out.double() - exact,
        bound,
        intra,
        slack=dtype_slack(mag, dtype, intra),
        what=f"two-level {na}x{nb} {intra} m={m} {dtype} pipeline={pipeline}",
    )
    return out


def _check_mesh(na, nb):
    mesh = init_device_mesh("cpu", (na, nb), mesh_dim_names=("inter", "intra"))
    for specs in SPEC_PAIRS:
        for m in CHUNKS:
            for pipeline in (1, 3):
                check_two_level(mesh, specs, m, torch.float32, "avg", pipeline)
        check_two_level(mesh, specs, 130, torch.bfloat16, "avg", 2)
        check_two_level(mesh, specs, 130, torch.float32, "sum", 1)
    return mesh


def _check_async(mesh):
    specs, m = SPEC_PAIRS[0], 150
    sync = check_two_level(mesh, specs, m, torch.float32, "avg", 2)
    x = rank_tensor(dist.get_rank(), mesh.size() * m, seed=0)
    out = torch.empty(m)
    work = hierarchical_reduce_scatter(
        out,
        x,
        mesh=mesh,
        intra_spec=specs[0],
        inter_spec=specs[1],
        pipeline=2,
        seed=SEED,
        async_op=True,
    )
    x.fill_(1e6)  # every piece was encoded before the call returned
    work.wait()
    assert torch.equal(out, sync)


def _check_single_level_equivalence(mesh):
    """A 1xB or Ax1 mesh is exactly the single-level reduce-scatter of that level."""
    na, nb = mesh.size(0), mesh.size(1)
    intra, inter = SPEC_PAIRS[0]
    out = check_two_level(mesh, SPEC_PAIRS[0], 37, torch.float32, "avg", 1, step=4)
    group = mesh.get_group(1 if na == 1 else 0)
    # The group is the world here, so the flat reduce-scatter's chunk r is the same chunk.
    assert dist.get_world_size(group) == dist.get_world_size()
    spec = intra if na == 1 else inter
    from qsdp.comm import reduce_scatter

    flat = torch.empty(37)
    reduce_scatter(
        flat,
        rank_tensor(dist.get_rank(), nb * na * 37, seed=4),
        group,
        spec=spec,
        seed=SEED,
        step=4,
    )
    assert torch.equal(out, flat)


def _check_unbiased(mesh):
    """Stochastic rounding on both hops: the mean error over steps vanishes."""
    specs, m, k = SPEC_PAIRS[0], 96, 48
    na, nb = mesh.size(0), mesh.size(1)
    ws = na * nb
    c = dist.get_rank()
    xs = [rank_tensor(j, ws * m, seed=1) for j in range(ws)]
    exact = sum(x[c * m : (c + 1) * m].double() for x in xs)
    errs = torch.empty(k, m, dtype=torch.float64)
    var = torch.zeros(m, dtype=torch.float64)
    for s in range(k):
        out = torch.empty(m)
        hierarchical_reduce_scatter(
            out, xs[c], mesh=mesh, intra_spec=specs[0], inter_spec=specs[1], op="sum", step=s
        )
        errs[s] = to_quant_domain(out.double() - exact, specs[0])
        if s < 4:  # the partials' steps barely move with the noise: a few steps give the scale
            _, bound = emulate(xs, na, nb, (c // nb, c % nb), m, *specs, 1, step=s)
            var = torch.maximum(var, bound**2)  # bound = sum of steps >= sqrt(sum of steps^2)
    assert mean_error_ok(errs, torch.sqrt(var))


def _worker(rank, ws, shapes):
    for na, nb in shapes:
        mesh = _check_mesh(na, nb)
        if na > 1 and nb > 1:
            _check_async(mesh)
            _check_unbiased(mesh)
        else:
            _check_single_level_equivalence(mesh)
    if ws == 4:  # the single-level helper still works beside the meshes' subgroups
        check_reduce_scatter(rank, ws, SPEC_PAIRS[0][0], 20, torch.float32, "avg")


@pytest.mark.parametrize(
    "world_size, shapes",
    [(3, [(1, 3), (3, 1)]), (4, [(2, 2), (1, 4), (4, 1)]), (6, [(3, 2)])],
    ids=["1x3,3x1", "2x2,1x4,4x1", "3x2"],
)
def test_hierarchical_reduce_scatter(world_size, shapes):
    run_distributed(_worker, world_size, shapes)


# --- meshes whose ranks are not in row-major order (issue #10) ---
_NEAREST8 = QuantSpec(bits=8, group_size=16, scheme="absmax", rounding="nearest")

PERMUTED = {
    4: [[[0, 2], [1, 3]], [[3, 1], [2, 0]], [[2, 0, 3, 1]], [[1], [3], [0], [2]]],
    6: [[[5, 1], [0, 4], [3, 2]]],
}


def _permuted_worker(rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    m = 37
    xs = [rank_tensor(j, ws * m, seed=5) for j in range(ws)]
    exact = sum(x[rank * m : (rank + 1) * m].double() for x in xs)
    # two 8-bit hops, nearest: each of the ws contributions is off by at most a step of its
    # chunk's max (8-bit absmax: max / 127), the owner's own by nothing
    bound = 2 * sum(x[rank * m : (rank + 1) * m].abs().max().double() for x in xs) / 127
    errors = {}
    layouts = []
    for rows in PERMUTED[ws]:
        mesh = DeviceMesh("cpu", rows, mesh_dim_names=("inter", "intra"))
        # worked out once per mesh ([Note: a mesh's layout, once]), each mesh its own
        layout = mesh_layout(mesh, None)
        assert mesh_layout(mesh, None) is layout
        assert layout.coord == tuple(mesh.get_coordinate())
        layouts.append(layout)
        for pipeline in (1, 2):
            out = torch.empty(m)
            hierarchical_reduce_scatter(
                out,
                xs[rank],
                mesh=mesh,
                intra_spec=_NEAREST8,
                inter_spec=_NEAREST8,
                op="sum",
                pipeline=pipeline,
            )
            errors[f"{rows} pipeline={pipeline}"] = float((out.double() - exact).abs().max())
    assert len({id(x) for x in layouts}) == len(layouts)
    # a flat group that does not hold the mesh's ranks is refused before any communication
    # (the mesh's layout without a group, kept above, does not stand in for it)
    sub = dist.new_group([0, 1])
    if rank < 2:
        with pytest.raises(ValueError, match="the mesh covers ranks"):
            hierarchical_reduce_scatter(
                torch.empty(m),
                xs[rank],
                mesh=mesh,
                intra_spec=_NEAREST8,
                inter_spec=_NEAREST8,
                group=sub,
            )
    return {"errors": errors, "bound": float(bound)}


@pytest.mark.parametrize("ws", [4, 6])
def test_any_rank_order(ws):
    """Chunk j ends on rank j whatever order the mesh lists its ranks in."""
    for rank, out in enumerate(run_distributed(_permuted_worker, ws)):
        for what, err in out["errors"].items():
            assert err <= out["bound"], f"rank {rank}, mesh {what}: error {err} > {out['bound']}"


# --- the intra-node encodes, one launch per run of rows ([Note: one launch per run of rows]) ---
def test_runs_of_cuts_rows_into_evenly_spaced_increasing_runs():
    assert runs_of((0, 2)) == ((0, 2, 0, 2),)  # (node, count, first row, stride)
    assert runs_of((1, 3, 5)) == ((0, 3, 1, 2),)
    assert runs_of((3, 1)) == ((0, 1, 3, 1), (1, 1, 1, 1))  # decreasing: a run each
    assert runs_of((5, 0, 3)) == ((0, 1, 5, 1), (1, 2, 0, 3))
    assert runs_of((0, 1, 3)) == ((0, 2, 0, 1), (2, 1, 3, 1))
    assert runs_of((4,)) == ((0, 1, 4, 1),)


@pytest.mark.parametrize(
    "chunk",
    [((0, 1), (2, 3), (4, 5)), ((5, 1), (0, 4), (3, 2)), ((0, 2, 4), (1, 3, 5))],
    ids=["3x2 row-major", "3x2 listed in another order", "2x3 by columns"],
)
def test_encode_intra_writes_an_encode_per_chunk(chunk):
    """At every coordinate of the mesh, ``encode_intra`` (Triton, interpreted on CPU) writes
    each peer's and the own column's payloads exactly where and as an encode per chunk would,
    with each chunk's noise, and leaves the own chunk's slot alone."""
    from qsdp.comm._mesh_layout import MeshLayout
    from qsdp.comm._two_level import encode_intra

    na, nb = len(chunk), len(chunk[0])
    intra = sdp4bit("stochastic")[0].propagating()
    m, piece = 300, (128, 150)  # a piece inside the chunk, not a whole number of groups
    chunks = torch.randn(na * nb, m, generator=torch.Generator().manual_seed(4))
    nbytes = intra.payload_bytes(piece[1])
    for a in range(na):
        for b in range(nb):
            layout = MeshLayout.of(
                inter=None,
                intra=None,
                coord=(a, b),
                chunk=chunk,
                intra_cols=tuple(range(nb)),
                inter_rows=tuple(range(na)),
            )
            stack = torch.full((nb, na, nbytes), 7, dtype=torch.uint8)
            send = torch.empty(nb - 1, na, nbytes, dtype=torch.uint8)

            def noise(c: int, a=a, b=b) -> int:
                return noise_stream(a * nb + b, c, bucket=3, piece=1)

            keys = dict(spec=intra, stream_of=noise, seed=11, step=2)
            encode_intra(
                chunks, piece, layout=layout, stack=stack, send=send, backend="triton", **keys
            )
            o, n = piece
            for dst in range(nb):
                rows = stack[nb - 1] if dst == b else send[dst - (dst > b)]
                for a2 in range(na):
                    if (a2, dst) == (a, b):
                        assert bool((rows[a2] == 7).all()), "the own chunk's slot was written"
                        continue
                    c = chunk[a2][dst]
                    want = encode(
                        chunks[c, o : o + n], intra, seed=11, step=2, stream=noise(c)
                    ).payload
                    assert torch.equal(rows[a2], want), (a, b, dst, a2)
