"""Split a flat FSDP chunk into the elements a policy quantizes and those it sends raw.

[Note: policies inside flat buffers]
FSDP2 hands each collective one flat buffer per parameter group; every rank's chunk is the
concatenation of the group's parameter shards (padded). A :class:`Split` lists, once, which
positions of a chunk belong to compressed parameters and which to raw ones. A collective then
gathers the two parts into contiguous buffers (index_select), runs the quantized collective on
the first and the plain one on the second, and scatters both back (index_copy): two collectives
instead of one, and no parameter is quantized against the policy. If FSDP hands over a chunk of
another size than the split was built for (parameters without gradients in this step), the hook
quantizes the whole chunk and counts it as ``policy_skipped`` in its byte counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policy import ParamPolicy

__all__ = ["Split", "build_split"]


@dataclass
class Split:
    """Positions of compressed and raw elements inside one rank's chunk of ``chunk`` elements."""

    chunk: int
    comp: torch.Tensor
    """int64 positions (CPU) of the quantized elements."""
    raw: torch.Tensor
    """int64 positions (CPU) of the elements sent as they are."""
    raw_names: tuple[str, ...]
    """The parameters sent raw (for reports)."""
    _on: dict = field(default_factory=dict, repr=False)

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed, raw) positions on ``device`` (cached)."""
        if device not in self._on:
            self._on[device] = (self.comp.to(device), self.raw.to(device))
        return self._on[device]


def build_split(
    layout: list[tuple[str, int, tuple[int, ...]]] | None, policy: ParamPolicy | None
) -> Split | None:
    """The split of a chunk laid out as ``(name, elements per rank, full shape)`` segments, or
    None when every parameter is quantized (or the layout is unknown)."""
    if policy is None or not layout:
        return None
    keep = [policy.compresses(name, shape) for name, _, shape in layout]
    if all(keep):
        return None
    comp, raw, offset = [], [], 0
    for (_, n, _), k in zip(layout, keep, strict=True):
        (comp if k else raw).append(torch.arange(offset, offset + n))
        offset += n
    empty = torch.empty(0, dtype=torch.int64)
    return Split(
        chunk=offset,
        comp=torch.cat(comp) if comp else empty,
        raw=torch.cat(raw) if raw else empty,
        raw_names=tuple(name for (name, _, _), k in zip(layout, keep, strict=True) if not k),
    )
