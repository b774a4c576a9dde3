"""The CUDA streams qsdp runs communication work on, apart from those NCCL and futures take.

[Note: side streams from the high-priority pool]
``torch.cuda.Stream()`` hands out PyTorch's pooled streams round-robin: 32 low-priority streams
per device, the same 32 that every NCCL communicator's internal stream comes from (unless its
process group asks for a high-priority one) and that CUDA futures run their callbacks on. A
hook stream that is also a communicator's stream joins two queues that must stay apart: on 4x
H200 over sockets, DDP ``global-qsgd`` pipelined in 100 MiB buckets, the first hook stream was
the default communicator's stream, which carries the scales' MAX, so the last bucket's MAX
queued behind the third bucket's decode (on that hook stream), which waited for the third
bucket's SUM, and the wire idled between the last two SUMs while the MAX and the encode ran
(profiled; the sibling [Note: a CUDA future without a callback] in ``qsdp.comm._common`` is the
same collision with a callback's stream; with both, the codes' SUMs left the link idle 5.2 ms
of a 100 ms step, 0.5 ms after the fixes: ``benchmarks/results/session16_2026-11-27/``). So qsdp's
own streams come from the high-priority pool, as FSDP2's own streams do: no default
communicator or callback takes from it, and the small encode kernels queued there run ahead of
the backward's kernels when both are ready. The communicators qsdp makes for itself (the second
communicator of pipelined buckets, staleness 1's twins) ask NCCL for a high-priority internal
stream too (:func:`side_group`): a new communicator's stream is the pool's next one, wherever
the round-robin stands, and one run that profiled both exchanges of a bucket on a single stream
(the scales' MAX and the codes' SUM of ``global-qsgd``, whose overlap is the point of the second
communicator) had drawn the default communicator's stream again. The twin 2-D mesh of
staleness 1's two-level reductions is built the same way (:func:`side_mesh`: ``DeviceMesh``'s
``backend_override`` with those options for every dimension).

The high-priority pool is round-robin too, 32 streams per device, and FSDP2's own streams
(all-gather copy-in, all-gather, reduce-scatter, all-reduce) and those high-priority
communicators draw from it: a side stream per hook wraps around it. Staleness 1 once made one
per FSDP group (25 for the 1.42 B GPT) and they came around to FSDP2's: in one profiled step
the compute stream waited 143 ms at the end of the backward for a delayed reduction that should
have run under the next step (4x H200, sockets: ``benchmarks/results/session17_2026-11-27/``;
a GPU test found three of FSDP2's streams among a 34-group model's delay streams).
So every user takes its streams from :class:`SideStreams`: two per device, made once, alternated
by the caller (one reduction's decode then never holds up the next one's encode).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SideStreams", "side_group", "side_mesh", "side_stream", "twin_group", "twin_groups"]

HIGH_PRIORITY = -1
"""The stream priority of qsdp's own streams (FSDP2's ``high_priority``; lower is higher)."""


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream of ``device`` for qsdp's communication work (hook streams, delayed
    reductions), from the high-priority pool ([Note: side streams from the high-priority
    pool])."""
    return torch.cuda.Stream(device, priority=HIGH_PRIORITY)


class SideStreams:
    """A fixed set of side streams per device (:func:`side_stream`), made on first use and
    handed out by turn: ``get(device, k)`` is the ``k % count``-th. A module that needs streams
    for many hooks holds one of these instead of a stream per hook
    ([Note: side streams from the high-priority pool])."""

    def __init__(self, count: int = 2) -> None:
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"SideStreams(count={count!r}) needs a positive int, e.g. 2")
        self.count = count
        self._made: dict[tuple[int | None, int], torch.cuda.Stream] = {}

    def get(self, device: torch.device, k: int) -> torch.cuda.Stream:
        """The ``k % count``-th side stream of ``device`` (a CUDA device)."""
        key = (device.index, k % self.count)
        stream = self._made.get(key)
        if stream is None:
            stream = self._made[key] = side_stream(device)
        return stream

    def made(self) -> list[torch.cuda.Stream]:
        """Every stream made so far."""
        return list(self._made.values())


def side_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``dist.new_group(ranks, **kwargs)`` for qsdp's own communication: on NCCL its internal
    stream comes from the high-priority pool, never the default communicator's stream
    ([Note: side streams from the high-priority pool]); other backends as they are."""
    if dist.get_backend() == "nccl" and "pg_options" not in kwargs:
        kwargs["pg_options"] = _high_priority_options()
    return dist.new_group(ranks, **kwargs)


_TWINS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_TWINS_OF: list[dist.ProcessGroup | None] = [None]  # the default group the twins belong to


def twin_group(ranks: list[int]) -> dist.ProcessGroup:
    """qsdp's own communicator over ``ranks`` (a :func:`side_group`): made once per process
    and set of ranks, and only by those ranks.

    [Note: qsdp's own communicators]
    A second communicator over a group's ranks lets qsdp's reductions overlap the collectives
    FSDP2 or DDP queue on the first (staleness 1, ``own_reduce_group``, pipelining). It is made
    with local synchronization (``new_group(..., use_local_synchronization=True)``): only its
    members take part, so pipeline stages that compress with different recipes never wait for
    each other, and nothing is exchanged over the world. Such a group is named by its ranks,
    so a second one over the same ranks would collide (and destroying one and making it again
    hangs on gloo): every model, hook and integration of the process over those ranks shares
    this one, made at first use. Each issues its collectives in the same order on every rank,
    so sharing is safe. A new default group (``destroy_process_group`` then
    ``init_process_group``) starts a new set.
    """
    world = dist.group.WORLD
    if _TWINS_OF[0] is not world:
        _TWINS.clear()
        _TWINS_OF[0] = world
    key = tuple(sorted(ranks))
    twin = _TWINS.get(key)
    if twin is None:
        twin = _TWINS[key] = side_group(list(key), use_local_synchronization=True)
    return twin


def twin_groups(groups: list[dist.ProcessGroup]) -> dict[str, dist.ProcessGroup]:
    """A second communicator over the same ranks for each of ``groups``, by group name: the
    process's :func:`twin_group` of those ranks ([Note: qsdp's own communicators]), made in
    sorted order, by their members only."""
    ranks = {g.group_name: tuple(dist.get_process_group_ranks(g)) for g in groups}
    made = {r: twin_group(list(r)) for r in sorted(set(ranks.values()))}
    return {name: made[r] for name, r in ranks.items()}


def _high_priority_options() -> dist.ProcessGroupNCCL.Options:
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def side_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh of ``mesh``'s layout on new communicators for qsdp's own communication (every
    dimension a new process group, the whole world's too); on NCCL their internal streams come
    from the high-priority pool, as :func:`side_group`'s. Call on every rank."""
    backend = dist.get_backend()
    override = tuple(
        (backend, _high_priority_options() if backend == "nccl" else None) for _ in range(mesh.ndim)
    )
    return DeviceMesh(
        mesh.device_type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, backend_override=override
    )
