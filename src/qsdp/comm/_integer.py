"""Global-QSGD: integer all-reduce and reduce-scatter whose plain SUM never overflows.

[Note: one MAX, one SUM]
Every rank computes the max-abs of each group of ``group_size`` elements and one MAX all-reduce
(float32) makes it the global scale ``M``. Each rank then rounds ``x * s / M`` to an integer in
``[-s, s]`` with ``s = floor(L / n)`` levels, ``L`` being the carrier's largest exactly summable
integer (127 for int8, 2048 for fp16, 2^31 - 1 for int32), so the plain SUM collective on the
carrier stays inside ``[-L, L]`` for any input and world size and is exact. No all-to-all, no
re-quantization per hop: the ring (or tree) of the backend does the sum. A group holding NaN or
Inf on any rank travels as an infinite scale through the MAX, so every rank raises together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..quant import CARRIERS, Rounding, global_int_decode, global_int_encode, global_int_levels
from ..quant.global_int import group_absmax, nonfinite_mode, rows_group_absmax
from . import _common as C
from ._calls import checked
from ._reduce_scatter import check_chunks
from ._split import Split, check_split
from ._stats import CommStats

__all__ = [
    "integer_all_reduce",
    "integer_all_reduce_wire_bytes",
    "integer_reduce_scatter",
    "integer_reduce_scatter_wire_bytes",
]


def _carrier_bytes(carrier: str) -> int:
    if carrier not in CARRIERS:
        raise ValueError(f"carrier={carrier!r} must be one of {sorted(CARRIERS)}; try 'int8'")
    return CARRIERS[carrier][0].itemsize


def levels_for(carrier: str, world_size: int) -> int:
    """Levels ``s`` the collectives use (:func:`qsdp.quant.global_int_levels`)."""
    return global_int_levels(carrier, world_size)


def _groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def integer_all_reduce_wire_bytes(
    numel: int,
    *,
    carrier: str = "int8",
    group_size: int = 128,
    split: Split | None = None,
    element_size: int = 4,
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`integer_all_reduce`.

    Returns:
        ``4 * ceil(numel / group_size)`` (the float32 MAX of the scales) plus
        ``numel * carrier bytes`` (the SUM); with a split, those of its compressed elements
        plus ``n_raw * element_size`` (the raw part's plain all-reduce).
    """
    if split is not None:
        comp = integer_all_reduce_wire_bytes(split.n_comp, carrier=carrier, group_size=group_size)
        return comp + split.n_raw * element_size
    return 4 * _groups(numel, group_size) + numel * _carrier_bytes(carrier)


def integer_reduce_scatter_wire_bytes(
    numel: int,
    world_size: int,
    *,
    carrier: str = "int8",
    group_size: int = 128,
    split: Split | None = None,
    element_size: int = 4,
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`integer_reduce_scatter`.

    Returns:
        ``4 * world_size * ceil(m / group_size)`` (the MAX all-reduce of the scales, grouped per
        destination chunk of ``m = numel / world_size`` elements) plus ``(world_size - 1) * m *
        carrier bytes`` (the SUM reduce-scatter's chunks bound for the peers); with a split,
        those of its compressed elements plus ``(world_size - 1) * n_raw * element_size``.
    """
    if split is not None:
        comp = integer_reduce_scatter_wire_bytes(
            world_size * split.n_comp, world_size, carrier=carrier, group_size=group_size
        )
        return comp + (world_size - 1) * split.n_raw * element_size
    m = numel // world_size
    return 4 * world_size * _groups(m, group_size) + (world_size - 1) * m * _carrier_bytes(carrier)


def _check_options(carrier: str, group_size: int, rounding: str | Rounding) -> Rounding:
    _carrier_bytes(carrier)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int; try 128")
    try:
        return Rounding(rounding)
    except ValueError:
        raise ValueError(f"rounding={rounding!r} must be 'stochastic' or 'nearest'") from None


def _check_global_scales(scales: torch.Tensor, what: str) -> None:
    bad = int((~torch.isfinite(scales)).sum())
    if bad:
        raise ValueError(
            f"{what}: {bad} groups hold NaN or Inf on at least one rank (found through the MAX "
            "all-reduce of the scales, so every rank raises); fix the source (a diverging loss, "
            "a missing grad clip) before reducing"
        )


@checked("integer_all_reduce")
def integer_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    carrier: str = "int8",
    op: str | dist.ReduceOp = "avg",
    group_size: int = 128,
    rounding: str | Rounding = "stochastic",
    async_op: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    stats: CommStats | None = None,
    nonfinite: str = "raise",
    split: Split | None = None,
    second_group: dist.ProcessGroup | None = None,
) -> C.CommWork | None:
    """Global-QSGD all-reduce of ``tensor`` in place: one MAX of scales, one integer SUM.

    Error bound (per element, against the exact float64 sum): with ``M`` the global max-abs of
    the element's group, ``s = floor(L / n)`` levels and the step ``d = max(M / s, 2^-126)``
    (floored for tiny groups: [Note: step floor] in ``qsdp.quant.reference``), each rank's code
    is off by at most ``d / 2`` (nearest) or ``< d`` (stochastic, unbiased), so the sum is within
    ``n * d / 2`` (resp. ``< n * d``), the mean within ``d / 2`` (resp. ``d``),
    plus the rounding to ``tensor``'s dtype and float32 scaling (a few ``M * 2^-24`` per rank,
    visible only with the int32 carrier, whose levels are capped at 2^24). The integer sum
    itself is exact: no overflow for any input, by the level rule.

    Args:
        tensor: float32/bf16/fp16, contiguous, any length; overwritten with the result.
        group: the process group (default: the world).
        carrier: ``"int8"`` (up to 127 ranks), ``"fp16"`` (integers exact up to 2048 ranks; NCCL
            has no int16) or ``"int32"``.
        op: ``"avg"`` (default) or ``"sum"``, or ``dist.ReduceOp.AVG`` / ``SUM``.
        group_size: elements sharing one scale.
        rounding: ``"stochastic"`` (unbiased, default) or ``"nearest"``.
        async_op: return a :class:`CommWork`; the scales' MAX runs before the call returns, the
            SUM is in flight until ``wait()``. Leave ``tensor`` alone until then.
        seed, step: key of the stochastic-rounding noise, the same on every rank; each rank gets
            its own stream (from its global rank and ``bucket``).
        bucket: separates buffers reduced in the same step.
        stats: the byte counter to record into (default :data:`qsdp.comm.comm_stats`).
        nonfinite: ``"raise"`` checks the all-reduced scales for NaN/Inf on the host (one sync
            per call, every rank raises); ``"propagate"`` skips the syncs: NaN/Inf groups decode
            to NaN/Inf (the FSDP hooks check gradients themselves, once per backward).
        split: which runs of ``tensor`` travel raw (see [Note: policies inside flat buffers]):
            they are summed by a second, plain all-reduce in ``tensor``'s dtype (NaN/Inf there
            reach every rank alike).
        second_group: run the SUM (and the raw part's all-reduce) on this communicator, over
            the same ranks as ``group`` in the same order (default: ``group``), so that one
            call's SUM runs beside the next call's MAX (see [Note: two communicators] in
            ``_two_phase.py``). The result is the same bits either way.

    Returns:
        A :class:`CommWork` when ``async_op``, else None.

    Raises:
        ValueError: NaN/Inf on any rank (all ranks raise; ``nonfinite="raise"``), too many
            ranks for the carrier, a ``second_group`` over other ranks.
    """
    rnd = _check_options(carrier, group_size, rounding)
    nonfinite = nonfinite_mode(nonfinite)
    op = C.parse_op(op)
    C.check_key(seed, step, bucket)
    C.check_float(tensor, "tensor")
    C.check_contiguous(tensor, "tensor")
    pg, n, _ = C.group_info(group)
    pgs = (pg, C.second_group(second_group, pg))
    levels = levels_for(carrier, n)
    stats = C.resolve_stats(stats)
    name = "integer_all_reduce"
    stats.count_call(name)
    args = (pgs, n, carrier, op, group_size, rnd, levels, seed, step, bucket, stats, nonfinite)
    if split is None:
        return C.run_stages(_all_reduce_stages(tensor, *args), async_op, result=tensor)
    stages = C.all_reduce_split(  # the raw part's all-reduce beside the codes' SUM
        tensor, split, lambda comp: _all_reduce_stages(comp, *args), pgs[1], op, stats, name
    )
    return C.run_stages(stages, async_op, result=tensor)


def _all_reduce_stages(
    tensor, pgs, n, carrier, op, group_size, rnd, levels, seed, step, bucket, stats, nonfinite
) -> C.Stages:
    """The MAX of the scales on ``pgs[0]``, the SUM of the codes on ``pgs[1]``."""
    name = "integer_all_reduce"
    flat = tensor.view(-1)
    if flat.numel() == 0:
        return
    scales = group_absmax(flat, group_size)
    yield [C.all_reduce(scales, dist.ReduceOp.MAX, pgs[0], stats, name)], False
    if nonfinite == "raise":
        _check_global_scales(scales, name)
    q = global_int_encode(
        flat,
        scales,
        levels,
        carrier=carrier,
        group_size=group_size,
        rounding=rnd,
        seed=seed,
        step=step,
        stream=C.noise_stream(C.noise_rank(pgs[0]), 0, bucket=bucket),
        nonfinite=nonfinite,
    )
    yield [C.all_reduce(q, dist.ReduceOp.SUM, pgs[1], stats, name)], True
    flat.copy_(global_int_decode(q, scales, levels, world_size=n, group_size=group_size, op=op))


@checked("integer_reduce_scatter")
def integer_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    carrier: str = "int8",
    op: str | dist.ReduceOp = "avg",
    group_size: int = 128,
    rounding: str | Rounding = "stochastic",
    async_op: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    stats: CommStats | None = None,
    nonfinite: str = "raise",
    split: Split | None = None,
) -> C.CommWork | None:
    """Global-QSGD reduce-scatter: MAX of scales, then the plain SUM reduce-scatter on integers.

    Groups are laid per destination chunk (``m = input.numel() / world_size`` elements, the last
    group of a chunk may be short), so a chunk's scales are its own. Error bound as in
    :func:`integer_all_reduce` (every rank's chunk is quantized, the own one included: the
    carrier sum needs every addend on the same grid).

    Args:
        output: ``m`` elements, float32/bf16/fp16, contiguous.
        input: ``world_size * m`` elements; chunk ``j`` is bound for rank ``j`` (the layout of
            ``dist.reduce_scatter_tensor``). Encoded before the call returns.
        group, carrier, op, group_size, rounding, async_op, seed, step, bucket, stats,
        nonfinite: as in
            :func:`integer_all_reduce`.
        split: which runs of each chunk travel raw, reduced by a second, plain SUM
            reduce-scatter in ``input``'s dtype; ``split.chunk`` must equal ``m``.

    Returns:
        A :class:`CommWork` when ``async_op``, else None.

    Raises:
        ValueError: NaN/Inf on any rank (all ranks raise), too many ranks for the carrier,
            ``input.numel()`` not divisible by the world size.
    """
    rnd = _check_options(carrier, group_size, rounding)
    nonfinite = nonfinite_mode(nonfinite)
    op = C.parse_op(op)
    C.check_key(seed, step, bucket)
    pg, n, _ = C.group_info(group)
    m = check_chunks(output, input, n, "integer_reduce_scatter")
    levels = levels_for(carrier, n)
    stats = C.resolve_stats(stats)
    name = "integer_reduce_scatter"
    stats.count_call(name)
    args = (carrier, op, group_size, rnd, levels, seed, step, bucket, stats, nonfinite)
    if split is None:
        stages = _reduce_scatter_stages(output, input, pg, n, m, *args)
        return C.run_stages(stages, async_op, result=output)
    check_split(split, m, "each chunk")
    comp, raw = split.take(input.reshape(n, m))
    comp_out = torch.empty(split.n_comp, dtype=output.dtype, device=output.device)
    raw_out = torch.empty(split.n_raw, dtype=raw.dtype, device=raw.device)

    def finish() -> None:
        if op == "avg":
            raw_out.div_(n)
        split.put(output.view(1, -1), comp_out.view(1, -1), raw_out.view(1, -1))

    stages = C.with_raw_part(
        _reduce_scatter_stages(comp_out, comp.reshape(-1), pg, n, split.n_comp, *args),
        lambda: C.reduce_scatter_sum(raw_out, raw.reshape(-1), pg, stats, name),
        finish,
    )
    return C.run_stages(stages, async_op, result=output)


def _reduce_scatter_stages(
    output,
    input,
    pg,
    n,
    m,
    carrier,
    op,
    group_size,
    rnd,
    levels,
    seed,
    step,
    bucket,
    stats,
    nonfinite,
) -> C.Stages:
    name = "integer_reduce_scatter"
    if m == 0:
        return
    chunks = input.reshape(n, m)
    scales = rows_group_absmax(chunks, group_size)  # (non-finite groups: +inf)
    yield [C.all_reduce(scales, dist.ReduceOp.MAX, pg, stats, name)], False
    if nonfinite == "raise":
        _check_global_scales(scales, name)
    dtype = CARRIERS[carrier][0]
    q = torch.empty(n, m, dtype=dtype, device=input.device)
    me = C.noise_rank(pg)
    for j in range(n):
        global_int_encode(
            chunks[j],
            scales[j],
            levels,
            carrier=carrier,
            group_size=group_size,
            rounding=rnd,
            seed=seed,
            step=step,
            stream=C.noise_stream(me, j, bucket=bucket),
            out=q[j],
            nonfinite=nonfinite,
        )
    summed = torch.empty(m, dtype=dtype, device=input.device)
    yield [C.reduce_scatter_sum(summed, q.view(-1), pg, stats, name)], True
    r = dist.get_rank(pg)
    output.view(-1).copy_(
        global_int_decode(summed, scales[r], levels, world_size=n, group_size=group_size, op=op)
    )
