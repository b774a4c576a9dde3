"""Split a flat chunk into the elements a collective quantizes and those it sends raw.

[Note: policies inside flat buffers]
FSDP2 and DDP hand a collective one flat buffer per parameter group (bucket), each rank's chunk
the concatenation of the parameters (shards). A :class:`Split` lists, once, which runs of a
chunk belong to compressed parameters and which travel raw (``qsdp.policy.ParamPolicy`` decides,
``ParamPolicy.split`` builds it). A collective given ``split=`` copies the two parts into
contiguous buffers (one ``cat`` each), sends the codes and the raw bytes together (one
``torch.distributed`` call where the two can share one: ``[codes | raw]`` rows, each part padded
to 16 bytes, see :func:`fused_row`), and copies both back (one ``_foreach_copy_``). No parameter
is quantized against the policy.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from ..quant import QuantSpec

__all__ = ["RowParts", "Split", "check_split", "fused_parts", "fused_row"]


@dataclass(frozen=True)
class Split:
    """Which runs of one rank's chunk of ``chunk`` elements are quantized and which are raw.

    Held as contiguous runs (a few per parameter group), not as position vectors: a vector
    costs 8 bytes per element of every shard on the device, more than the optimizer state.
    """

    chunk: int
    runs: tuple[tuple[int, int, bool], ...]
    """``(start, length, compressed)`` runs covering the chunk in order, neighbours merged."""
    raw_names: tuple[str, ...] = field(default=(), compare=False)
    """The parameters sent raw (for reports: not part of what the split is, so the equal splits
    of two groups with equal blocks are equal, and share a replayed site's buffers)."""

    @classmethod
    def of(cls, parts: Iterable[tuple[int, bool]], *, raw_names: tuple[str, ...] = ()) -> Split:
        """The split of ``(length, compressed)`` parts laid end to end, in chunk order: empty
        parts dropped, neighbours of one kind merged into one run."""
        runs: list[tuple[int, int, bool]] = []
        offset = 0
        for n, compressed in parts:
            if n == 0:
                continue
            if runs and runs[-1][2] == compressed:
                start, m, _ = runs[-1]
                runs[-1] = (start, m + n, compressed)
            else:
                runs.append((offset, n, compressed))
            offset += n
        return cls(chunk=offset, runs=tuple(runs), raw_names=raw_names)

    def __post_init__(self) -> None:
        covered = 0
        for start, n, _ in self.runs:
            if start != covered or n <= 0:
                raise ValueError(f"Split.runs={self.runs!r} must cover [0, chunk) in order")
            covered += n
        if covered != self.chunk:
            raise ValueError(f"Split.runs cover {covered} elements, not chunk={self.chunk}")

    @cached_property
    def n_comp(self) -> int:
        """Elements of the compressed runs (worked out once: a hot path reads it per call)."""
        return sum(n for _, n, c in self.runs if c)

    @cached_property
    def n_raw(self) -> int:
        """Elements of the raw runs."""
        return sum(n for _, n, c in self.runs if not c)

    def __hash__(self) -> int:
        # the two-phase all-reduce looks its layout up by split on every call
        # (``_two_phase._chunked``): the tuple of runs is hashed once, not on every lookup
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.chunk, self.runs))

    def __getstate__(self) -> dict:
        # (a string's hash differs between processes: another process hashes anew)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed, raw) int64 positions on the CPU (for tests and reports)."""
        empty = torch.empty(0, dtype=torch.int64)
        parts = {True: [empty], False: [empty]}
        for start, n, c in self.runs:
            parts[c].append(torch.arange(start, start + n))
        return torch.cat(parts[True]), torch.cat(parts[False])

    @cached_property
    def _plan(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Worked out once per split ([Note: a split's plan]): every run's length, and the
        indices of the compressed runs and of the raw ones among them."""
        lengths = tuple(n for _, n, _ in self.runs)
        comp = tuple(i for i, (_, _, c) in enumerate(self.runs) if c)
        raw = tuple(i for i, (_, _, c) in enumerate(self.runs) if not c)
        return lengths, comp, raw

    @cached_property
    def _part_lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The compressed runs' lengths and the raw runs', in chunk order."""
        lengths, comp, raw = self._plan
        return tuple(lengths[i] for i in comp), tuple(lengths[i] for i in raw)

    def take(
        self,
        rows: torch.Tensor,
        *,
        comp_out: torch.Tensor | None = None,
        raw_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (``[k, chunk]``) as contiguous ``[k, n_comp]`` and ``[k, n_raw]`` copies,
        written into ``comp_out`` and ``raw_out`` when given (a slot of a send buffer, a
        captured segment's buffer: no temporary and no second copy).

        [Note: a split's plan]
        A split is applied on every call of a collective, so the host work per call counts
        (issue 32: each torch op costs the host ~7 us on a GPU machine): the runs' lengths and
        which are compressed are worked out once, and the runs are cut by one
        ``split_with_sizes`` (one op for all the views), not by a slice per run."""
        lengths, comp, raw = self._plan
        pieces = rows.split_with_sizes(lengths, dim=1)
        return _cat(rows, pieces, comp, comp_out), _cat(rows, pieces, raw, raw_out)

    @cached_property
    def one_run_each(self) -> bool:
        """Whether each part is at most one run (then :meth:`views` copies nothing)."""
        return sum(c for _, _, c in self.runs) <= 1 and sum(not c for _, _, c in self.runs) <= 1

    def views(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`take`, but views of ``rows`` when :attr:`one_run_each` (each row of a view
        is contiguous; writing through a view writes ``rows``), copies otherwise."""
        if not self.one_run_each:
            return self.take(rows)
        comp, raw = self._one_runs
        return rows[:, comp[0] : comp[1]], rows[:, raw[0] : raw[1]]

    @cached_property
    def _one_runs(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """With :attr:`one_run_each`: ``(start, end)`` of the compressed run and of the raw
        one (``(0, 0)`` for a part without), for :meth:`views`' two slices."""
        found = {True: (0, 0), False: (0, 0)}
        for start, n, c in self.runs:
            found[c] = (start, start + n)
        return found[True], found[False]

    def put(self, rows: torch.Tensor, comp: torch.Tensor | None, raw: torch.Tensor | None) -> None:
        """Write ``comp`` (``[k, n_comp]``) and ``raw`` (``[k, n_raw]``) back into ``rows``
        (one ``_foreach_copy_``); a part given as None is left as it is.

        [Note: a put of contiguous pieces]
        Each run of each row is copied as its own contiguous 1-D piece, not as a ``[k, run]``
        column block: a column block of a ``[k, chunk]`` buffer is strided, which takes
        ``_foreach_copy_`` off its fused route (one copy kernel per block, each in the
        non-vectorized strided loop); contiguous pieces go through its multi-tensor kernels
        (`qsdp-w8g8`'s gathers on the 1.42 B GPT, 2x H200, session 39: 10.2 -> 8.1 ms a step,
        3x the 2.7 ms its 11.6 GB read and written take at the H200's 4.3 TB/s device copy
        bandwidth; a payload per run, each decoded into its place with contiguous stores, would
        remove the pass: a scatter inside the decode kernel was slower, ``decode_kernel``'s
        docstring). A tensor laid out as one block is cut in one
        ``split_with_sizes`` over its flat view (the runs of every row, row after row: worked
        out once per split and ``k``); a tensor whose rows are apart (a column of a payload)
        row by row."""
        k = rows.shape[0]
        if not k:
            return
        lengths, comp_i, raw_i = self._plan
        dst = _row_pieces(rows, lengths)
        targets, sources = [], []
        pairs = zip((comp_i, raw_i), (comp, raw), self._part_lengths, strict=True)
        for indices, part, sizes in pairs:
            if indices and part is not None:
                # a part's pieces, row after row, go to these pieces of ``rows``
                targets += [dst[i] for i in _row_major(indices, len(lengths), k)]
                sources += _row_pieces(part, sizes)
        torch._foreach_copy_(targets, sources)

    def places(self, *, compressed: bool) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of the compressed (or raw) runs, in chunk order (cached)."""
        return self._places[compressed]

    @cached_property
    def _places(self) -> dict[bool, tuple[tuple[int, int], ...]]:
        return {c: tuple((s, n) for s, n, k in self.runs if k == c) for c in (True, False)}


def _row_pieces(t: torch.Tensor, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """The ``[k, sum(lengths)]`` tensor ``t`` cut into its rows' runs, each a contiguous 1-D
    view, row after row ([Note: a put of contiguous pieces])."""
    k = t.shape[0]
    if t.is_contiguous():
        return list(t.view(-1).split_with_sizes(_repeat(lengths, k)))
    return [piece for row in t.unbind(0) for piece in row.split_with_sizes(lengths)]


@functools.lru_cache(maxsize=256)
def _row_major(indices: tuple[int, ...], per_row: int, k: int) -> tuple[int, ...]:
    """Where the runs ``indices`` of each of ``k`` rows of ``per_row`` runs sit among all the
    rows' runs, row after row (:meth:`Split.put`'s targets, worked out once per split and
    ``k``)."""
    return tuple(j * per_row + i for j in range(k) for i in indices)


@functools.lru_cache(maxsize=256)
def _repeat(lengths: tuple[int, ...], k: int) -> tuple[int, ...]:
    """``lengths`` ``k`` times, end to end (one split of a flat ``[k, chunk]`` buffer)."""
    return lengths * k


def _cat(
    rows: torch.Tensor,
    pieces: tuple[torch.Tensor, ...],
    indices: tuple[int, ...],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``pieces[indices]`` side by side (``[k, sum]``), into ``out`` when given."""
    if not indices:
        return rows.new_empty((rows.shape[0], 0)) if out is None else out
    return torch.cat([pieces[i] for i in indices], dim=1, out=out)


def fused_row(spec: QuantSpec, n_comp: int, raw_bytes: int) -> tuple[int, int]:
    """(offset of the raw bytes, bytes per row) of one ``[codes | raw]`` payload: the codes of
    ``n_comp`` elements, then ``raw_bytes`` raw bytes, each padded to 16 bytes so every row's
    parts start on a scale-word (and float) boundary."""
    at = -(-spec.payload_bytes(n_comp) // 16) * 16
    return at, at + -(-raw_bytes // 16) * 16


def check_split(split: object, numel: int, what: str) -> None:
    """Refuse a ``split=`` argument that is not a :class:`Split` of ``numel`` elements (the
    chunk ``what`` names)."""
    if not isinstance(split, Split) or split.chunk != numel:
        covers = f"covers {split.chunk} elements" if isinstance(split, Split) else "is no Split"
        raise ValueError(
            f"split={split!r} {covers}, but {what} has {numel}; build it for this chunk: "
            "ParamPolicy.split of its layout"
        )


class RowParts(NamedTuple):
    """One ``[codes | raw]`` row's layout (:func:`fused_parts`)."""

    nbytes: int
    """Bytes of the codes' payload."""
    row: int
    """Bytes of the row, both parts padded."""
    parts: tuple[int, int, int, int]
    """The row cut in four: codes, their padding, raw bytes, their padding (``split`` sizes)."""


@functools.lru_cache(maxsize=1024)
def fused_parts(spec: QuantSpec, n_comp: int, raw_bytes: int) -> RowParts:
    """:func:`fused_row` with the row's four parts, worked out once per (spec, sizes): a
    collective cuts every call's buffers by them ([Note: a split's plan])."""
    nbytes = spec.payload_bytes(n_comp)
    at, row = fused_row(spec, n_comp, raw_bytes)
    return RowParts(nbytes, row, (nbytes, at - nbytes, raw_bytes, row - at - raw_bytes))
