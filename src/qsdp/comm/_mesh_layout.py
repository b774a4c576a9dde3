"""Where each rank of a 2-D (inter, intra) device mesh sits: the two-level reduce-scatter's
layout, worked out once per mesh and group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshLayout", "Run", "mesh_layout", "runs_of"]


class Run(NamedTuple):
    """Rows ``first, first + stride, ...`` (``count`` of them) of an input, the nodes
    ``node, node + 1, ...`` of a column of the mesh: one strided ``[count, m]`` view."""

    node: int
    count: int
    first: int
    stride: int


def runs_of(rows: tuple[int, ...]) -> tuple[Run, ...]:
    """``rows`` (the input row of each node, in node order) cut into the fewest runs of evenly
    spaced, increasing rows."""
    runs: list[Run] = []
    for node, row in enumerate(rows):
        if runs:
            last = runs[-1]
            stride = row - last.first if last.count == 1 else last.stride
            if stride > 0 and row == last.first + stride * last.count:
                runs[-1] = Run(last.node, last.count + 1, last.first, stride)
                continue
        runs.append(Run(node, 1, row, 1))
    return tuple(runs)


@dataclass(frozen=True, eq=False)
class MeshLayout:
    """Where each mesh coordinate sits in the two groups and in the flat layout.

    [Note: any rank order]
    A ``DeviceMesh`` may list its ranks in any order (``DeviceMesh("cuda", [[0, 2], [1, 3]])``);
    its row and column groups number their members by global rank, not by mesh coordinate. The
    collective works in mesh coordinates ``(a, b)`` and translates at its edges: ``chunk[a][b]``
    is the row of the input bound for coordinate ``(a, b)`` (the position of that rank in the
    flat group), ``intra_cols[j]`` / ``inter_rows[j]`` the coordinate of the intra / inter group's
    rank ``j`` (all-to-all splits are indexed by group rank). For a row-major mesh all three are
    the identity and the collective is what it always was.
    """

    inter: dist.ProcessGroup
    intra: dist.ProcessGroup
    coord: tuple[int, int]
    chunk: tuple[tuple[int, ...], ...]
    intra_cols: tuple[int, ...]
    inter_rows: tuple[int, ...]
    columns: tuple[tuple[Run, ...], ...] = ()
    """Per intra group rank ``j``: the rows of the input bound for its column (coordinates
    ``(a', intra_cols[j])`` for every node ``a'``) as runs of evenly spaced rows (one encode
    launch each, [Note: one launch per run of rows] in ``_two_level``)."""
    others: tuple[tuple[int, int], ...] = ()
    """``(node, input row)`` of each other node's chunk for this rank's local index, in the
    inter group's rank order: the middle hop's slots."""

    me_intra: int = 0
    """This rank's rank in the intra group."""
    me_inter: int = 0
    """This rank's rank in the inter group."""
    sub_order: tuple[int, ...] | None = None
    """A mesh of one level: the input rows in the order its only group numbers its ranks,
    where that differs from the flat layout's (None: the same order)."""

    def chunk_of(self, a: int, b: int) -> int:
        return self.chunk[a][b]

    @classmethod
    def of(
        cls,
        *,
        inter: dist.ProcessGroup,
        intra: dist.ProcessGroup,
        coord: tuple[int, int],
        chunk: tuple[tuple[int, ...], ...],
        intra_cols: tuple[int, ...],
        inter_rows: tuple[int, ...],
    ) -> MeshLayout:
        """The layout of coordinate ``coord`` with the fields derived from the others."""
        a, b = coord
        sub_order = None
        if len(chunk) == 1 or len(chunk[0]) == 1:  # one level: the mesh's only group's order
            flat = [r for row in chunk for r in row]
            order = tuple(flat[j] for j in (intra_cols if len(chunk) == 1 else inter_rows))
            sub_order = None if order == tuple(sorted(order)) else order
        return cls(
            inter=inter,
            intra=intra,
            coord=coord,
            chunk=chunk,
            intra_cols=intra_cols,
            inter_rows=inter_rows,
            columns=tuple(runs_of(tuple(row[dst] for row in chunk)) for dst in intra_cols),
            others=tuple((a2, chunk[a2][b]) for a2 in inter_rows if a2 != a),
            me_intra=intra_cols.index(b),
            me_inter=inter_rows.index(a),
            sub_order=sub_order,
        )


# [Note: a mesh's layout, once]
# A layout depends only on the mesh and the flat group, objects that live as long as the
# training does; working it out (the mesh's coordinate, each group's ranks, the checks) cost the
# host 50-70 us a call, in every block's reduce-scatter of every step (issue 32: the host binds
# on 2 nodes x 2). So it is worked out once per (mesh, group) pair of objects and kept here with
# them: the entry holds both, so neither id can be reused while it lives, and a new mesh (or
# group) is a new entry. Bounded: the oldest entries go first.
_LAYOUTS: dict[tuple[int, int], tuple[DeviceMesh, object, MeshLayout]] = {}
_LAYOUTS_KEPT = 64


def mesh_layout(mesh: DeviceMesh, group: dist.ProcessGroup | None) -> MeshLayout:
    """:func:`_new_layout`, once per (mesh, group) ([Note: a mesh's layout, once])."""
    key = (id(mesh), id(group))
    hit = _LAYOUTS.get(key)
    if hit is not None:  # (the entry holds mesh and group: their ids are theirs alone)
        return hit[2]
    layout = _new_layout(mesh, group)
    while len(_LAYOUTS) >= _LAYOUTS_KEPT:
        del _LAYOUTS[next(iter(_LAYOUTS))]
    _LAYOUTS[key] = (mesh, group, layout)
    return layout


def _new_layout(mesh: DeviceMesh, group: dist.ProcessGroup | None) -> MeshLayout:
    """Validate ``mesh`` (and ``group``, the flat layout's group) and map its coordinates."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a 2-D DeviceMesh (inter, intra), got {type(mesh).__name__}; build it "
            "with init_device_mesh(device, (nodes, gpus_per_node), "
            "mesh_dim_names=('inter', 'intra'))"
        )
    if mesh.ndim != 2:
        raise ValueError(
            f"mesh has {mesh.ndim} dims ({mesh.mesh.shape=}); hierarchical_reduce_scatter needs "
            "a 2-D mesh (inter, intra)"
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(
            f"this process (rank {dist.get_rank()}) is not part of the mesh {mesh.mesh.tolist()}"
        )
    a, b = coord
    ranks = mesh.mesh.tolist()
    flat = sorted(r for row in ranks for r in row)
    if group is None:
        position = {r: i for i, r in enumerate(flat)}
    else:
        members = dist.get_process_group_ranks(group)
        if sorted(members) != flat:
            raise ValueError(
                f"the mesh covers ranks {flat} but the reduce-scatter's group holds "
                f"{sorted(members)}: build the mesh over exactly the ranks of the group (for "
                "FSDP2, the ranks it shards over)"
            )
        position = {r: dist.get_group_rank(group, r) for r in flat}
    inter, intra = mesh.get_group(0), mesh.get_group(1)
    cols = {r: j for j, r in enumerate(ranks[a])}
    rows = {row[b]: i for i, row in enumerate(ranks)}

    def coords(pg: dist.ProcessGroup, where: dict[int, int], dim: str) -> tuple[int, ...]:
        members = [dist.get_global_rank(pg, j) for j in range(pg.size())]
        if sorted(members) != sorted(where):
            raise ValueError(
                f"the mesh's {dim} group holds ranks {members}, not its {dim} slice "
                f"{sorted(where)}: pass a DeviceMesh whose groups are its own rows and columns"
            )
        return tuple(where[r] for r in members)

    return MeshLayout.of(
        inter=inter,
        intra=intra,
        coord=(a, b),
        chunk=tuple(tuple(position[r] for r in row) for row in ranks),
        intra_cols=coords(intra, cols, "intra"),
        inter_rows=coords(inter, rows, "inter"),
    )
