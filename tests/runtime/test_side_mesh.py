"""qsdp.runtime.side_mesh: a mesh of the same layout on communicators of qsdp's own (staleness
1's twin mesh), on real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from qsdp.runtime import SideStreams, side_mesh
from qsdp.testing import run_distributed


def _twin(rank: int, world: int, shape: tuple[int, int]) -> list[tuple[list[int], bool, float]]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("inter", "intra"))
    twin = side_mesh(mesh)
    assert twin.mesh_dim_names == mesh.mesh_dim_names and torch.equal(twin.mesh, mesh.mesh)
    out = []
    for dim in ("inter", "intra"):
        mine, theirs = twin.get_group(dim), mesh.get_group(dim)
        ranks = dist.get_process_group_ranks(mine)
        assert ranks == dist.get_process_group_ranks(theirs)  # the same peers
        # ... on a communicator of its own: not the mesh's, not the default one
        own = mine.group_name != theirs.group_name and mine is not dist.group.WORLD
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=mine)  # and it reduces over those peers
        out.append((ranks, own, float(t)))
    return out


def test_side_mesh_has_the_layout_on_new_communicators():
    for rank, got in enumerate(run_distributed(_twin, 4, (2, 2))):
        (inter, own_inter, s_inter), (intra, own_intra, s_intra) = got
        assert own_inter and own_intra
        assert intra == [rank // 2 * 2, rank // 2 * 2 + 1] and inter == [rank % 2, rank % 2 + 2]
        assert s_intra == sum(r + 1 for r in intra) and s_inter == sum(r + 1 for r in inter)
    # a dimension that spans the world (one node of 3) gets a new group too
    for got in run_distributed(_twin, 3, (1, 3)):
        assert got[1] == ([0, 1, 2], True, 6.0), got


def test_side_streams_refuse_a_count_below_one():
    with pytest.raises(ValueError, match=r"SideStreams\(count=0\) needs a positive int"):
        SideStreams(0)
    assert SideStreams().count == 2 and SideStreams().made() == []
