"""Flags read on the device, without a host sync, so a collective can agree on them across
ranks first: which groups of encoded payloads were flagged (NaN/Inf, or not representable), and
which runs of a flat input hold such values (:func:`run_flags`, a reduction's per-parameter
NaN/Inf check), and a tensor zeroed where such a flag is set (:func:`zero_flagged`)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from ._tables import on_device
from .codec import Backend, _resolve
from .spec import QuantSpec

__all__ = ["flagged_groups", "run_flags", "zero_flagged", "zero_flagged_each"]

#: The largest float32: ``|x| <= limit`` with ``limit`` at most this is false for +-Inf and NaN.
_FLOAT32_MAX = torch.finfo(torch.float32).max


def run_flags(
    rows: torch.Tensor,
    sizes: Sequence[int],
    *,
    limit: float = float("inf"),
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-run flags of a flat input: ``flags[p] = 1`` where run ``p`` (the ``sizes[p]``
    elements after the runs before it) of any row holds NaN, +-Inf or ``|x| > limit``.

    A reduction checks its input with it, one flag per parameter (the runs): the Triton path
    is one launch and one zeroed buffer per call, where the reference (``torch._foreach_norm``
    of every run, then the largest over the rows and a comparison) is five or more. Values are
    compared in float32 (bf16 and fp16 values are exact there), against ``limit`` in float32,
    at most the largest float32, so an Inf is flagged whatever the limit.

    Args:
        rows: ``[k, sum(sizes)]`` float32/bf16/fp16 with unit column stride (FSDP2's rank-major
            reduce-scatter input, or one row).
        sizes: the runs' lengths in order (zero allowed: such a run is never flagged).
        limit: the largest magnitude that is not flagged (default: only NaN/Inf are).
        backend: ``"auto"`` (Triton on CUDA, the reference on CPU), ``"triton"`` or
            ``"reference"``.
        out: where to write the flags (int32 ``[len(sizes)]`` on ``rows``' device; a replayed
            check's persistent word), else a new tensor. One run over a whole tensor is its
            NaN/Inf check in one read-only pass, no temporary of its size
            (``~torch.isfinite(x).all()`` writes a bool per element and reads it again).

    Returns:
        int32 ``[len(sizes)]`` on ``rows``' device (``out`` when given).
    """
    if rows.dim() != 2 or rows.shape[1] != sum(sizes) or (rows.numel() and rows.stride(1) != 1):
        raise ValueError(
            f"run_flags: rows {tuple(rows.shape)} (strides {rows.stride()}) must be [k, "
            f"{sum(sizes)}] with unit column stride for runs of {list(sizes)} elements"
        )
    if out is not None and (
        out.dtype != torch.int32 or out.shape != (len(sizes),) or out.device != rows.device
    ):
        raise ValueError(
            f"run_flags: out must be int32 [{len(sizes)}] on {rows.device}, got {out.dtype} "
            f"{list(out.shape)} on {out.device}"
        )
    lim = min(float(limit), _FLOAT32_MAX)
    if _resolve(backend, rows.device) == "reference":
        flags = _run_flags_reference(rows, sizes, lim)
        return flags if out is None else out.copy_(flags)
    from ._triton import launch

    if out is None:
        flags = torch.zeros(len(sizes), dtype=torch.int32, device=rows.device)
    else:
        flags = out.zero_()  # (the kernel only sets flags)
    ends = on_device(_ends(tuple(sizes)), dtype=torch.int64, device=rows.device)
    launch.run_flags(rows, ends=ends, flags=flags, limit=lim)
    return flags


@functools.lru_cache(maxsize=1024)
def _ends(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The runs' cumulative ends (worked out once per layout: every reduction asks)."""
    return tuple(itertools.accumulate(sizes))


def _run_flags_reference(rows: torch.Tensor, sizes: Sequence[int], limit: float) -> torch.Tensor:
    """:func:`run_flags` in torch: the largest magnitude of each run of each row in one fused
    pass and no temporaries of the input's size (``torch._foreach_norm`` with ``ord=inf``,
    which propagates NaN, as ``clip_grad_norm_`` uses it), the largest over the rows, compared
    in float32."""
    k = rows.shape[0]
    if k == 0:
        return torch.zeros(len(sizes), dtype=torch.int32, device=rows.device)
    # every row's runs in one cut of the flat rows (not a split per row: fewer ops per call)
    pieces = [p for p in rows.reshape(-1).split(list(sizes) * k) if p.numel()]
    norms = iter(torch._foreach_norm(pieces, ord=float("inf")) if pieces else ())
    zero = rows.new_zeros(()) if 0 in sizes else None  # an empty run holds nothing to flag
    # (no indexing by a Python list: that copies the index to the device, a host sync)
    peak = torch.stack([next(norms) if n else zero for _ in range(k) for n in sizes])
    peak = peak.view(k, len(sizes)).amax(dim=0).float()
    return (~(peak <= limit)).to(torch.int32)


def zero_flagged(x: torch.Tensor, flag: torch.Tensor, *, backend: Backend = "auto") -> None:
    """Zero ``x`` in place where ``flag`` is set, on the device (no host read): a reduction's
    result, or a group's gradients, that held NaN/Inf on some rank.

    ``masked_fill_(flag, 0)`` reads and writes every element whether the flag is set or not:
    every gradient shard once a step, at the end of the backward, where the optimizer waits for
    it. The Triton path reads the flag and writes only when it is set, and never reads ``x``
    (flags are almost never set).

    Args:
        x: any float tensor; contiguous on the Triton path.
        flag: one element, int32, uint8 or bool, on ``x``'s device (a view into a tensor of
            flags is fine): nonzero zeroes ``x``.
        backend: ``"auto"`` (Triton on CUDA, the reference on CPU), ``"triton"`` or
            ``"reference"``.
    """
    if flag.numel() != 1 or flag.dtype not in (torch.int32, torch.uint8, torch.bool):
        raise ValueError(
            f"zero_flagged: flag must be one int32, uint8 or bool element, got {flag.dtype} of "
            f"{flag.numel()} elements"
        )
    if flag.device != x.device:
        raise ValueError(f"zero_flagged: flag on {flag.device}, x on {x.device}: put both on one")
    if _resolve(backend, x.device) == "reference":
        _zero_flagged_reference(x, flag)
        return
    if not x.is_contiguous():
        raise ValueError(
            f"zero_flagged: the Triton path needs a contiguous x, got shape {tuple(x.shape)} "
            f"strides {x.stride()}; pass x.contiguous()'s source or backend='reference'"
        )
    from ._triton import launch

    launch.zero_flagged(x, flag=flag.view(torch.uint8) if flag.dtype == torch.bool else flag)


def zero_flagged_each(
    xs: Sequence[torch.Tensor],
    flags: torch.Tensor,
    which: Sequence[int],
    *,
    backend: Backend = "auto",
) -> None:
    """:func:`zero_flagged` of many tensors at once: ``xs[j]`` zeroed in place where
    ``flags[which[j]]`` is set (a backward's NaN/Inf verdict: each FSDP2 group's gradient span
    and the flag its group agreed). On CUDA one launch per element size among ``xs``, not one
    per tensor (25 a step of a 24-block GPT), reading only the flags where they are clear.

    Args:
        xs: float tensors on ``flags``' device; contiguous on the Triton path (empty ones are
            skipped).
        flags: 1-D int32 or uint8 (or bool) on the device.
        which: for each of ``xs`` the index of its flag, ``0 <= which[j] < len(flags)``.
        backend: ``"auto"`` (Triton on CUDA, the reference on CPU), ``"triton"`` or
            ``"reference"``.
    """
    if len(which) != len(xs):
        raise ValueError(f"zero_flagged_each: {len(xs)} tensors but {len(which)} flag indices")
    if flags.dim() != 1 or flags.dtype not in (torch.int32, torch.uint8, torch.bool):
        raise ValueError(
            f"zero_flagged_each: flags must be 1-D int32, uint8 or bool, got {flags.dtype} "
            f"{list(flags.shape)}"
        )
    bad = [w for w in which if not 0 <= w < flags.numel()]
    if bad:
        raise ValueError(f"zero_flagged_each: flag indices {bad} outside the {flags.numel()} flags")
    devices = {x.device for x in xs} - {flags.device}
    if devices:
        raise ValueError(
            f"zero_flagged_each: tensors on {sorted(map(str, devices))}, flags on "
            f"{flags.device}: put them on one device"
        )
    live = [j for j, x in enumerate(xs) if x.numel()]
    if not live:
        return
    if _resolve(backend, flags.device) == "reference":
        for j in live:
            _zero_flagged_reference(xs[j], flags[which[j]])
        return
    strided = [j for j in live if not xs[j].is_contiguous()]
    if strided:
        raise ValueError(
            f"zero_flagged_each: the Triton path needs contiguous tensors; xs{strided} are not "
            "(zero them with zero_flagged(x, flag, backend='reference'))"
        )
    from ._triton import launch

    launch.zero_flagged_each(
        [xs[j] for j in live],
        flags=flags.view(torch.uint8) if flags.dtype == torch.bool else flags,
        which=[which[j] for j in live],
    )


def _zero_flagged_reference(x: torch.Tensor, flag: torch.Tensor) -> None:
    """:func:`zero_flagged` in torch: ``masked_fill_`` with the flag as a 0-d bool."""
    bad = flag.reshape(())
    x.masked_fill_(bad if bad.dtype == torch.bool else bad != 0, 0)


def flagged_groups(payloads: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """Number of flagged groups in ``k`` payloads stacked as ``[k, payload_bytes]``.

    An encode marks a group it cannot represent (NaN/Inf in it, or a range past float32) by a
    NaN first scale field (``qsdp.quant.reference``); this counts them.

    Args:
        payloads: uint8 ``[k, spec.payload_bytes(numel)]`` (rows may be strided), or 1-D for one.
        numel: elements each payload encodes.
        spec: the quantizer that made them.

    Returns:
        An int64 scalar tensor on the payloads' device (read it with ``int()`` when needed).
    """
    rows = payloads.reshape(1, -1) if payloads.dim() == 1 else payloads
    if numel == 0 or rows.shape[0] == 0:
        return torch.zeros((), dtype=torch.int64, device=rows.device)
    ng = spec.num_groups(numel)
    # the scales lead each payload; a copy makes them aligned for the float view
    raw = rows[:, : ng * spec.scale_bytes].contiguous().reshape(-1, spec.scale_bytes)
    first = raw.view(spec.scale_dtype)[:, 0]
    return torch.isnan(first).sum()
