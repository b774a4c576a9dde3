"""Split a flat FSDP chunk into the elements a policy quantizes and those it sends raw.

[Note: policies inside flat buffers]
FSDP2 hands each collective one flat buffer per parameter group; every rank's chunk is the
concatenation of the group's parameter shards (padded). A :class:`Split` lists, once, which
runs of a chunk belong to compressed parameters and which to raw ones. A collective then
copies the two parts into contiguous buffers (one ``cat`` each), runs the quantized collective
on the first and the plain one on the second, and copies both back (one ``_foreach_copy_``):
two collectives instead of one, and no parameter is quantized against the policy. If FSDP
hands over a chunk of another size than the split was built for (parameters without gradients
in this step), the hook quantizes the whole chunk and counts it as ``policy_skipped`` in its
byte counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policy import ParamPolicy

__all__ = ["Split", "build_split"]


@dataclass(frozen=True)
class Split:
    """Which runs of one rank's chunk of ``chunk`` elements are quantized and which are raw.

    Held as contiguous runs (a few per parameter group), not as position vectors: a vector
    costs 8 bytes per element of every shard on the device, more than the optimizer state.
    """

    chunk: int
    runs: tuple[tuple[int, int, bool], ...]
    """``(start, length, compressed)`` runs covering the chunk in order, neighbours merged."""
    raw_names: tuple[str, ...]
    """The parameters sent raw (for reports)."""

    @property
    def n_comp(self) -> int:
        return sum(n for _, n, c in self.runs if c)

    @property
    def n_raw(self) -> int:
        return sum(n for _, n, c in self.runs if not c)

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed, raw) int64 positions on the CPU (for tests and reports)."""
        empty = torch.empty(0, dtype=torch.int64)
        parts = {True: [empty], False: [empty]}
        for start, n, c in self.runs:
            parts[c].append(torch.arange(start, start + n))
        return torch.cat(parts[True]), torch.cat(parts[False])

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (``[k, chunk]``) as contiguous ``[k, n_comp]`` and ``[k, n_raw]`` copies."""
        out = []
        for want in (True, False):
            pieces = [rows[:, s : s + n] for s, n, c in self.runs if c == want]
            out.append(torch.cat(pieces, dim=1) if pieces else rows.new_empty((rows.shape[0], 0)))
        return out[0], out[1]

    def put(self, rows: torch.Tensor, comp: torch.Tensor, raw: torch.Tensor) -> None:
        """Write ``comp`` (``[k, n_comp]``) and ``raw`` (``[k, n_raw]``) back into ``rows``."""
        dst, src, offset = [], [], {True: 0, False: 0}
        for start, n, c in self.runs:
            part = comp if c else raw
            dst.append(rows[:, start : start + n])
            src.append(part[:, offset[c] : offset[c] + n])
            offset[c] += n
        torch._foreach_copy_(dst, src)


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
    runs: list[tuple[int, int, bool]] = []
    offset = 0
    for (_, n, _), k in zip(layout, keep, strict=True):
        if n == 0:
            continue
        if runs and runs[-1][2] == k:
            start, m, _ = runs[-1]
            runs[-1] = (start, m + n, k)
        else:
            runs.append((offset, n, k))
        offset += n
    return Split(
        chunk=offset,
        runs=tuple(runs),
        raw_names=tuple(name for (name, _, _), k in zip(layout, keep, strict=True) if not k),
    )
