"""The exact part of a reduction's receive side: rows summed onto a base in float32, divided and
put at their places, in one launch on a GPU (:func:`sum_rows_finish`).

A reduce-scatter with a policy split sends the raw (uncompressed) parameters beside the codes
([Note: policies inside flat buffers] in ``qsdp.comm._split``); the receiver sums the ``n - 1``
peers' raw values onto its own, divides for an average and writes them to their runs of the
output. In torch that is a float32 copy, ``n - 1`` adds, a division into a temporary and a copy
to the runs: ~10 torch ops a call for a few thousand elements (the norms' and biases'), each a
launch the host pays for (issue 32); here it is one kernel, and the torch code below its
specification.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from ._tables import on_device
from .codec import Backend, _check_float, _misfit, _put_runs, _resolve, divide_into

__all__ = ["sum_rows_finish"]


def sum_rows_finish(
    rows: torch.Tensor,
    *,
    base: torch.Tensor,
    out: torch.Tensor,
    places: Sequence[tuple[int, int]],
    divisor: int | None = None,
    backend: Backend = "auto",
) -> None:
    """``out`` at ``places`` gets ``(base + rows[0] + ... + rows[k-1]) / divisor``.

    Summed in float32 in that order (each value widened to float32 first), divided by IEEE
    division when ``divisor`` is given, rounded once to ``out``'s dtype: the bits of the float32
    copy of ``base``, an ``add_`` per row, :func:`~qsdp.quant.divide_into` and a copy.

    Args:
        rows: ``[k, numel]`` float values (any float dtype) with unit column stride; rows may
            be strided (e.g. the raw part of received ``[codes | raw]`` rows, viewed as floats).
        base: ``numel`` float values with unit stride (the rank's own), only read.
        out: a contiguous 1-D float tensor.
        places: ``(start, length)`` runs of ``out``, in order, covering ``numel`` elements.
        divisor: divide by it (``op="avg"`` over that many ranks), or None.
        backend: ``"auto"`` (Triton on CUDA, the torch reference on CPU), ``"triton"`` or
            ``"reference"``.
    """
    _check_float(rows, "rows")
    _check_float(base, "base")
    _check_float(out, "out")
    k, numel = rows.shape if rows.dim() == 2 else (-1, -1)
    if (
        rows.dim() != 2
        or (numel and k and rows.stride(1) != 1)
        or rows.device != out.device
        or _misfit(base, out, places, numel)
    ):
        raise ValueError(
            f"sum_rows_finish: rows {tuple(rows.shape)} (strides {rows.stride()}), base "
            f"{tuple(base.shape)} (strides {base.stride()}), out {tuple(out.shape)}, places "
            f"{tuple(places)}: rows must be [k, n] with unit column stride, base n elements "
            "with unit stride, out 1-D contiguous, the places (start, length) inside out, in "
            "order, not overlapping, covering n elements, all on one device"
        )
    if numel == 0:
        return
    if _resolve(backend, out.device) == "triton":
        if numel >= 2**31:
            raise ValueError(
                f"sum_rows_finish: {numel} elements; the kernel indexes them with int32 (fewer "
                "than 2**31): pass backend='reference'"
            )
        from ._triton import launch

        ends, starts = _tables(tuple(places))
        launch.row_sum(
            rows,
            base=base,
            out=out,
            ends=on_device(ends, dtype=torch.int64, device=out.device),
            starts=on_device(starts, dtype=torch.int64, device=out.device),
            divisor=divisor,
        )
        return
    acc = base.to(torch.float32, copy=True)
    for row in rows.unbind(0):
        acc.add_(row)
    if divisor is not None:
        divide_into(acc, acc, divisor)
    _put_runs(out, acc, places)


@functools.lru_cache(maxsize=1024)
def _tables(places: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The runs' cumulative ends in the summed values and their starts in ``out`` (the
    kernel's tables, worked out once per layout)."""
    return tuple(itertools.accumulate(n for _, n in places)), tuple(s for s, _ in places)
