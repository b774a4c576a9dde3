"""The device tables of a launch over many tensors: one kernel reaches every tensor of a set
from the set's first, by element offsets ([Note: one launch per group] in
``qsdp.runtime._adam_triton``, where weight prediction first used them; ``zero_flagged_each``
zeroes a backward's flagged gradient spans with them).

A launch's tables depend only on where its tensors lie relative to each other and on their
lengths, which a model's groups keep from step to step: each table is built once per layout and
stream (copied from pinned memory, the host never waiting) and looked up after that, the least
recently used dropped past :data:`MAX_TABLES`. :data:`plans_built` counts the offset tables
built (a layout that changed every step would show as a count that grows)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton

__all__ = ["Layout", "Programs", "layout_of", "offsets", "plans_built", "programs"]

#: Tables kept (a model's groups, each with its gather and, for DDP, its in-place move).
MAX_TABLES = 1024

_tables: OrderedDict[tuple, object] = OrderedDict()
plans_built = 0
"""Offset tables built and copied to the device so far."""


class Programs(NamedTuple):
    """What a grid reads of its tensors' lengths: each program's tensor (``param``), each
    tensor's first program and length."""

    numel: torch.Tensor
    param: torch.Tensor
    first: torch.Tensor
    programs: int


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """``t`` on ``device``: copied from pinned memory, the host never waiting, on the current
    stream (the only one that reads it: the stream is in every table's key, so a launch on it
    finds the table there, and an evicted table's memory returns to that stream's pool after
    its last launch)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _cached(key: tuple, build: Callable[[], object]):
    """The table of ``key``, built by ``build()`` at its first use (the least recently used of
    more than ``MAX_TABLES`` dropped)."""
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = build()
        if len(_tables) > MAX_TABLES:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
    return table


def programs(device: torch.device, stream: int, numels: tuple[int, ...], *, block: int) -> Programs:
    """The grid over tensors of ``numels`` elements, ``block`` elements a program: by their
    lengths alone, so a group whose buffers move between steps (its offsets rebuilt) keeps it;
    the larger table (one entry per program)."""

    def build() -> Programs:
        counts = [triton.cdiv(n, block) for n in numels]
        first = [0]
        for c in counts[:-1]:
            first.append(first[-1] + c)
        index = torch.arange(len(numels), dtype=torch.int32)
        return Programs(
            numel=_on(device, torch.tensor(numels, dtype=torch.int64)),
            param=_on(device, torch.repeat_interleave(index, torch.tensor(counts))),
            first=_on(device, torch.tensor(first, dtype=torch.int32)),
            programs=sum(counts),
        )

    return _cached(("programs", device, stream, block, numels), build)


def offsets(device: torch.device, stream: int, rel: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """The int64 table of ``rel`` (each set's entries one after the other: the tensors' element
    offsets from their set's first, or any per-tensor numbers a kernel reads beside them),
    built once per layout and stream."""

    def build() -> torch.Tensor:
        global plans_built
        plans_built += 1
        return _on(device, torch.tensor([r for s in rel for r in s], dtype=torch.int64))

    return _cached(("offsets", device, stream, rel), build)


class Layout(NamedTuple):
    """Where one launch's tensors lie: each set's element offsets from its first (an
    :func:`offsets` table's contents) and whether the first ``aligned_sets`` sets' tensors and
    every length are 16-byte aligned."""

    rel: tuple[tuple[int, ...], ...]
    aligned: bool


_layouts: OrderedDict[tuple, Layout] = OrderedDict()


def layout_of(
    chosen: Sequence[Sequence[torch.Tensor]],
    numels: tuple[int, ...],
    *,
    aligned_sets: int,
    what: str,
) -> Layout:
    """The layout of one launch's tensor sets (each of one element size), worked out once per
    layout: keyed by each set's byte offsets from its first tensor, the first tensors'
    alignment and element sizes and the lengths, which a group keeps from step to step while
    its estimates and buffers are new ones: a call reads each tensor's address once, no
    per-element arithmetic. ``what`` names the kernel in the error of a tensor a fraction of an
    element from its set's first."""
    bases = [ts[0].data_ptr() for ts in chosen]
    key = (
        numels,
        aligned_sets,
        tuple(b % 16 for b in bases),
        tuple(ts[0].element_size() for ts in chosen),
        *(tuple(u.data_ptr() - b for u in ts) for ts, b in zip(chosen, bases, strict=True)),
    )
    found = _layouts.get(key)
    if found is not None:
        _layouts.move_to_end(key)
        return found
    _, _, align, sizes, *apart = key
    if any(d % size for ds, size in zip(apart, sizes, strict=True) for d in ds):
        raise ValueError(
            f"{what}: two tensors of one dtype lie a fraction of an element apart (a byte view "
            "reinterpreted at an odd offset?); pass tensors aligned to their element size"
        )
    rel = tuple(tuple(d // size for d in ds) for ds, size in zip(apart, sizes, strict=True))
    aligned = all(a == 0 for a in align[:aligned_sets]) and all(
        d % 16 == 0 for ds in apart[:aligned_sets] for d in ds
    )
    found = _layouts[key] = Layout(rel, aligned and all(n % 16 == 0 for n in numels))
    if len(_layouts) > MAX_TABLES:
        _layouts.popitem(last=False)
    return found
