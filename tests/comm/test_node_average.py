"""The two-level reduce-scatter's ``node_average``: the own chunk averaged over the node, handed
over as soon as the intra-node level is summed (staleness 1's estimate of the result)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from qsdp.comm import Split, hierarchical_reduce_scatter
from qsdp.comm._hierarchical import _pieces
from qsdp.quant import decode_sum
from qsdp.testing import rank_tensor, run_distributed

from .test_hierarchical import SEED, SPEC_PAIRS, _intra_payload


def _node_sum(xs, na, nb, coord, m, intra, pipeline) -> torch.Tensor:
    """The own chunk plus the node peers' contributions as their intra-node codes carry them,
    decoded in the order the collective decodes them."""
    a, b = coord
    c = a * nb + b
    acc = xs[c][c * m : (c + 1) * m].to(torch.float32, copy=True)
    peers = [b2 for b2 in range(nb) if b2 != b]
    for piece in enumerate(_pieces(m, intra.group_size, pipeline)):
        _, (o, n) = piece
        payloads = torch.stack(
            [_intra_payload(xs, a * nb + b2, c, m, piece, intra, step=0, bucket=0) for b2 in peers]
        )
        decode_sum(payloads, n, intra, out=acc[o : o + n], accumulate=True)
    return acc


def _reduce(mesh, x: torch.Tensor, specs, **kw) -> tuple[list, torch.Tensor, object]:
    """(what ``node_average`` received, the output, the work) of one reduce-scatter of ``x``."""
    seen, out = [], torch.empty(x.numel() // mesh.size())
    intra, inter = specs
    work = hierarchical_reduce_scatter(
        out,
        x,
        mesh=mesh,
        intra_spec=intra,
        inter_spec=inter,
        seed=SEED,
        node_average=seen.append,
        **kw,
    )
    return seen, out, work


def _estimates(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("inter", "intra"))
    na, nb = mesh.size(0), mesh.size(1)
    coord = tuple(mesh.get_coordinate())
    for intra, inter in SPEC_PAIRS:
        for m, pipeline in ((200, 1), (200, 3), (45, 1)):
            xs = [rank_tensor(j, world * m, seed=0) for j in range(world)]
            seen, out, work = _reduce(
                mesh, xs[rank], (intra, inter), pipeline=pipeline, async_op=True
            )
            assert len(seen) == 1  # handed over before the inter-node exchange is waited for
            work.wait()
            assert len(seen) == 1  # once
            want = _node_sum(xs, na, nb, coord, m, intra, pipeline) / nb
            torch.testing.assert_close(seen[0], want, rtol=0, atol=0)
            # the estimate is not the result: the other node's gradients are not in it
            assert not torch.equal(seen[0], out)
    # with a policy split: the raw runs, which have no node level, are the own values
    intra, inter = SPEC_PAIRS[1]
    m = 200
    split = Split(chunk=m, runs=((0, 70, True), (70, 10, False), (80, 120, True)))
    xs = [rank_tensor(j, world * m, seed=1) for j in range(world)]
    seen, _, _ = _reduce(mesh, xs[rank], (intra, inter), split=split)
    own = xs[rank][rank * m : (rank + 1) * m]
    torch.testing.assert_close(seen[0][70:80], own[70:80], rtol=0, atol=0)
    # the compressed runs: the node's average through the peers' 8-bit codes, close, not exact
    node = [coord[0] * nb + b for b in range(nb)]
    exact = torch.stack([xs[j][rank * m : (rank + 1) * m] for j in node]).mean(0)
    keep = torch.cat([torch.arange(0, 70), torch.arange(80, 200)])
    err = (seen[0][keep] - exact[keep]).abs().max()
    assert 0 < err < 0.02 * exact.abs().max(), err
    # one level: one rank per node (2x1) hands over its own chunk; one node (1x2) the average
    for shape in ((world, 1), (1, world)):
        flat = init_device_mesh("cpu", shape, mesh_dim_names=("inter", "intra"))
        x = rank_tensor(rank, world * 30, seed=2)
        seen, out, _ = _reduce(flat, x, (intra, inter))
        want = x[rank * 30 : (rank + 1) * 30] if shape[1] == 1 else out
        torch.testing.assert_close(seen[0], want.float(), rtol=0, atol=0)
    dist.barrier()


def test_node_average_is_the_own_chunk_over_the_node():
    run_distributed(_estimates, 4)
