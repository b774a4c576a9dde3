"""Every rank installs the same compression: checked once, when it is installed.

[Note: one config on every rank]
A compressed collective only works if every rank of it encodes and decodes alike: the same
widths, groups, schemes, seeds (the shift-lattice scheme's offsets come from the seed on both
sides) and staleness. A program that passes different recipes or overrides on different ranks
(a rank-dependent environment variable, a config file read per node) would not fail loudly:
payload sizes that happen to match decode as garbage, sizes that differ hang. So
``compress_fsdp`` and ``qsdp.ddp.register`` start with one all-gather of a 64-bit digest of
their arguments over the ranks that will communicate, before anything can raise on one rank
alone, and every rank raises the same error when they differ.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..comm import group_device

__all__ = ["check_same_arguments"]


def check_same_arguments(arguments: object, *, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` (default: the world) unless every rank
    passed the same ``arguments`` (compared by their ``repr``: configs are frozen dataclasses
    of plain values). A collective over ``group``; a no-op without ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        return
    text = repr(arguments)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=group_device(group))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    digests = [int(t) for t in every]
    if len(set(digests)) == 1:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(every)))
    others = [r for r, d in zip(ranks, digests, strict=True) if d != digests[0]]
    raise ValueError(
        f"{what}: ranks {others} passed other arguments than rank {ranks[0]} (of ranks "
        f"{ranks}); every rank must install the same compression, or the ranks would encode "
        f"and decode differently. This rank ({dist.get_rank()}) passed {text}; pass the same "
        "recipe, overrides and seed on every rank"
    )
