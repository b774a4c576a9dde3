"""Every rank installs the same compression: checked once, when it is installed, over the groups
the model communicates on.

[Note: one config on every rank]
A compressed collective only works if every rank of it encodes and decodes alike: the same
widths, groups, schemes, seeds (the shift-lattice scheme's offsets come from the seed on both
sides) and staleness. A program that passes different recipes or overrides on different ranks
(a rank-dependent environment variable, a config file read per node) would not fail loudly:
payload sizes that happen to match decode as garbage, sizes that differ hang. So
``compress_fsdp`` and ``qsdp.ddp.register`` start with one all-gather of a 64-bit digest of
their arguments over each group the model communicates on, before anything can raise on one
rank alone, and every rank of those groups raises the same error when they differ.

[Note: agreement over the model's groups]
The groups are the model's own (FSDP2's shard group, HSDP's replicate group, DDP's group), in
an order every rank derives alike (the shard groups in module order, then the replicate group,
then a two-level mesh's dimensions), never the world: pipeline stages shard their own parts
over their own ranks and may run other recipes. A verdict (a mismatch, a mesh that contradicts
the layout) found by some ranks reaches all of them by one MAX all-reduce per group, the groups
taken twice in turn: on the grid of shard and replicate groups (HSDP), or any set of groups
whose union connects the ranks, every rank then holds the same verdict. What cannot be seen
without a collective over the world is a rank that passes a group its peers in that group do
not (one node passing ``replicate=``, the other not): that rank's collective waits for the
process group's timeout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import group_device

__all__ = ["agree_verdict", "check_same_arguments", "distinct_groups"]

Groups = Sequence[dist.ProcessGroup | None]


def distinct_groups(groups: Groups) -> list[dist.ProcessGroup | None]:
    """``groups`` without repeats (by their ranks), in their first order; None is the world."""
    seen, out = set(), []
    for g in groups:
        key = None if g is None else tuple(dist.get_process_group_ranks(g))
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def check_same_arguments(arguments: object, *, groups: Groups, what: str) -> None:
    """Raise ``ValueError`` on every rank of ``groups`` unless every rank of each passed the
    same ``arguments`` (compared by their ``repr``: configs are frozen dataclasses of plain
    values). Collectives over ``groups`` only ([Note: agreement over the model's groups]); a
    no-op without ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        return
    groups = distinct_groups(groups)
    text = repr(arguments)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    problem = ""
    for group in groups:
        mine = torch.tensor([digest], dtype=torch.int64, device=group_device(group))
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        digests = [int(t) for t in every]
        if len(set(digests)) > 1 and not problem:
            ranks = _ranks(group, len(every))
            others = [r for r, d in zip(ranks, digests, strict=True) if d != digests[0]]
            problem = f"ranks {others} passed other arguments than rank {ranks[0]} (of {ranks})"
    agree_verdict(
        problem,
        groups=groups,
        what=what,
        fix=(
            "every rank must install the same compression, or the ranks would encode and "
            f"decode differently. This rank ({dist.get_rank()}) passed {text}; pass the same "
            "recipe, overrides and seed on every rank"
        ),
    )


def agree_verdict(problem: str, *, groups: Groups, what: str, fix: str) -> None:
    """Raise ``ValueError`` on every rank of ``groups`` if any rank's ``problem`` is not empty
    (its own text where it has one, else that another rank found one). One MAX all-reduce per
    group, the groups taken twice ([Note: agreement over the model's groups])."""
    if not dist.is_available() or not dist.is_initialized():
        if problem:
            raise ValueError(f"{what}: {problem}; {fix}")
        return
    groups = distinct_groups(groups)
    flag = int(bool(problem))
    for group in groups * 2 if len(groups) > 1 else groups:
        t = torch.tensor([flag], dtype=torch.int32, device=group_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flag = int(t)
    if flag:
        raise ValueError(f"{what}: {problem or 'another rank found a problem'}; {fix}")


def _ranks(group: dist.ProcessGroup | None, n: int) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(n))
