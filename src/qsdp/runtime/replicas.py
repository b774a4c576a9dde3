"""Whether the replicas of a model hold the same bits: DDP's ranks, each HSDP shard's replicas.

[Note: checking replicas]
Data parallelism is correct only while every replica holds the same parameters: a compressed
exchange that hands different results to different ranks (a defect, a memory race: one was found
in compressed HSDP on 2026-11-27, see ``qsdp/fsdp/_replicate.py``) trains on silently, and a
``torch.distributed.checkpoint`` save keeps one replica's copy of each replicated tensor, so the
difference is lost without a trace. :func:`replica_mismatches` compares one checksum per
parameter (the sum of its bits as integers, of each rank's local shard) across the replicas: a
few bytes per parameter tensor on the wire, not the model. ``qsdp train`` runs
:func:`check_replicas` before every checkpoint of a DDP or HSDP run; the benchmarks after every
variant (through ``qsdp.testing.assert_replicas_agree``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import dist_all_gather
from .placement import local_of

__all__ = ["check_replicas", "replica_mismatches"]

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replica_mismatches(module: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """The parameters of ``module`` whose bits differ between the ranks of ``group`` (the ranks
    that replicate it; default: the world), each with the ranks that differ from the group's
    first: ``"blocks.0.w (ranks [2] differ from rank 0)"``. Collective over ``group``: call it
    on every rank of it; every rank of it gets the same list."""
    names, sums = [], []
    for name, p in module.named_parameters():
        bits = local_of(p).detach().contiguous().reshape(-1)
        names.append(name)
        sums.append(bits.view(_AS_INT[bits.element_size()]).sum(dtype=torch.int64))
    if not sums:
        return []
    mine = torch.stack(sums)
    n = dist.get_world_size(group)
    rows = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist_all_gather()(rows, mine, group=group)
    rows = rows.view(n, -1).cpu()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    return [
        f"{names[i]} (ranks {[ranks[j] for j in range(n) if rows[j, i] != rows[0, i]]} differ "
        f"from rank {ranks[0]})"
        for i in range(mine.numel())
        if not bool((rows[:, i] == rows[0, i]).all())
    ]


def check_replicas(
    module: nn.Module, group: dist.ProcessGroup | None = None, *, where: str = ""
) -> None:
    """Raise on every rank of the world if the replicas of ``module`` differ in any group: the
    ranks of ``group`` (this rank's replicas) compare their parameters, then the world agrees on
    one verdict (a MAX), so ranks whose own replicas agree raise too, and none goes on into a
    collective the others left. Call it on every rank."""
    bad = replica_mismatches(module, group)
    device = next(module.parameters()).device
    flag = torch.tensor([len(bad)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        mine = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "") if bad else "none here"
        raise RuntimeError(
            f"qsdp: the replicas of the model differ{' ' + where if where else ''} (this rank's "
            f"replicas: {mine}): an exchange gave different ranks different results, which is "
            "a defect; please report it with the run's settings (recipe, mesh, dtypes, torch "
            "version)"
        )
