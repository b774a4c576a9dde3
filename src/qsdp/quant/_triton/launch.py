"""Launchers of the Triton quantizer kernels: shapes, grids and constexpr flags.

Every argument is named by the kernel's own parameter name (a launcher builds one dict of them;
:func:`_launch` hands them over in the kernel's parameter order, [Note: a launch's host cost]).
What a ``QuantSpec`` fixes at compile time is worked out once per spec by :func:`_consts` and
splatted (``**c.encoding``), so two kernels cannot receive the same flags in different orders.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..philox import random_signs
from ..reference import headroom, step_cap
from ..spec import QuantSpec, Rounding, Scheme, inv_sqrt
from . import kernels as K
from . import tables

_SCHEME_ID = {Scheme.ABSMAX: 0, Scheme.MINMAX: 1, Scheme.SHIFT_LATTICE: 2}
#: Elements per program; a program always holds whole groups.
_BLOCK = 4096
_NUM_WARPS = 4


def _rows(group_size: int, block: int) -> int:
    """Groups per program: whole groups filling about ``block`` elements."""
    return max(1, block // group_size)


@dataclass(frozen=True, kw_only=True)
class _Consts:
    """What one ``QuantSpec`` fixes for the kernels, as their keyword arguments.

    Built once per ``(spec, rotate, block)`` by :func:`_consts` and shared: never mutate its
    dicts, only splat them into a launch (plain dicts, since a read-only proxy costs a
    microsecond more per launch to splat). Keys are the kernels' own parameter names.
    """

    tile: Mapping[str, int]
    """``ROWS``, ``GPB``, ``HB``: the program's ``[ROWS, GPB, HB]`` tile (kernels' [Note: one
    tile, three kernels])."""
    tile_numel: int
    """Elements of one tile: the step of the main grid."""
    codes: Mapping[str, int | bool]
    """``BITS``, ``SCHEME``, ``SCALE_BF16``: how the payload's codes and scales read."""
    in_codes: Mapping[str, int | bool]
    """``codes`` under the input-side names of ``decode_sum_encode_kernel`` (``IN_BITS``, ...)."""
    quantize: Mapping[str, bool | float]
    """``STOCHASTIC``, ``STEP_CAP``, ``HEADROOM``: how values become codes (encoding kernels)."""
    rotation: Mapping[str, bool | int]
    """``ROTATE``, ``HAS_SIGNS``, ``LOG_H``: the Hadamard rotation of the rotating kernels."""
    inv_sqrt_h: float
    """The rotation's float32 scale ``1/sqrt(h)`` (a run-time argument, not a constexpr)."""
    encoding: Mapping[str, object]
    """``tile``, ``codes``, ``quantize``, ``rotation`` and ``inv_sqrt_h`` in one dict: what
    ``encode_kernel`` takes from the spec, splatted once per launch (not four merges)."""
    decoding: Mapping[str, object]
    """``tile``, ``codes``, ``rotation`` and ``inv_sqrt_h``: ``decode_kernel``'s share."""


@functools.lru_cache(maxsize=256)
def _consts(spec: QuantSpec, *, rotate: bool, block: int) -> _Consts:
    """The kernels' compile-time description of ``spec``: ``rotate`` says whether the kernel
    rotates (then ``HB`` is the Hadamard block), ``block`` is ``_BLOCK`` (an argument, not read
    here, because the benchmarks tune it at run time)."""
    h = spec.hadamard_block or 16
    rotates = bool(spec.hadamard_block) and rotate
    hb = spec.hadamard_block if rotates else spec.group_size
    rows = _rows(spec.group_size, block)
    codes = {
        "BITS": spec.bits,
        "SCHEME": _SCHEME_ID[spec.scheme],
        "SCALE_BF16": spec.scale_dtype == torch.bfloat16,
    }
    tile = {"ROWS": rows, "GPB": spec.group_size // hb, "HB": hb}
    quantize = {
        "STOCHASTIC": spec.rounding is Rounding.STOCHASTIC,
        # the representable-range constants (reference's [Note: representable range])
        "STEP_CAP": step_cap(spec),
        "HEADROOM": headroom(spec),
    }
    rotation = {
        "ROTATE": rotates,
        "HAS_SIGNS": spec.hadamard_seed is not None,
        "LOG_H": h.bit_length() - 1,
    }
    scale = {"inv_sqrt_h": inv_sqrt(h)}
    return _Consts(
        tile=tile,
        tile_numel=rows * spec.group_size,
        codes=codes,
        in_codes={f"IN_{k}": v for k, v in codes.items()},
        quantize=quantize,
        rotation=rotation,
        inv_sqrt_h=scale["inv_sqrt_h"],
        encoding={**tile, **codes, **quantize, **rotation, **scale},
        decoding={**tile, **codes, **rotation, **scale},
    )


@functools.lru_cache(maxsize=4096)
def _sizes(spec: QuantSpec, numel: int) -> dict[str, int]:
    """The payload layout of ``numel`` elements, under the kernels' argument names (shared:
    never mutate it, only splat it)."""
    n_groups = spec.num_groups(numel)
    return {
        "scale_region": n_groups * spec.scale_bytes,
        "n_code_bytes": spec.code_bytes(numel),
        "n_groups": n_groups,
    }


@functools.lru_cache(maxsize=64)
def _signs(h: int, seed: int, device: torch.device) -> torch.Tensor:
    return random_signs(h, seed, device=device)


def _signs_ptr(spec: QuantSpec, placeholder: torch.Tensor) -> torch.Tensor:
    """The rotation's +-1 signs on ``placeholder``'s device, or ``placeholder`` itself when
    ``spec`` has none (the kernel then never reads it)."""
    if spec.hadamard_seed is None:
        return placeholder
    return _signs(spec.hadamard_block, spec.hadamard_seed, placeholder.device)


def _launch(kernel, kwargs: dict, *, tile_numel: int, grid_rows: int = 1) -> None:
    """Launch the mask-free main grid over whole tiles of ``tile_numel`` elements, then one TAIL
    program for the rest (``grid_rows`` independent rows on grid axis 1, for the kernels that
    take them); ``kwargs`` are the kernel's arguments, ``numel`` among them.

    [Note: a launch's host cost]
    The hooks are host-bound on a GPU machine (issue 32), and a launch is most of a codec
    call's host work there: ``JITFunction.run`` binds and specializes every argument (about
    26 us on an H200 host for the encode kernel's 35 keyword arguments, against 9 us for the
    compiled kernel's own launcher, ``benchmarks/host_primitives.py``), and each ``**`` layer on
    the way copied the argument dict again. So a launcher builds the arguments once, as one
    dict under the kernel's parameter names (what a spec and a length fix comes from cached
    dicts: ``_Consts.encoding`` / ``decoding``, ``_sizes``), and this passes them to
    ``kernel.run`` positionally, in the kernel's own parameter order (``arg_names``), with no
    ``kernel[grid]`` (``KernelInterface``'s lambda around the same call: one more copy per
    launch). Same kernel, same arguments, same bits (Triton and its interpreter alike); on the
    development CPU with a no-op kernel an encode call's Python fell from 14.5 to 6.4 us.
    """
    whole, rest = divmod(kwargs["numel"], tile_numel)
    names = kernel.arg_names  # (every parameter: positional, no keyword matching per launch)
    # (programs, pid_base, TAIL): the whole tiles' grid, then the rest's one program
    for programs, pid_base, tail in ((whole, 0, False), (int(rest > 0), whole, True)):
        if programs:
            kwargs["pid_base"], kwargs["TAIL"] = pid_base, tail
            kernel.run(
                *[kwargs[n] for n in names],
                grid=(programs, grid_rows),
                warmup=False,
                num_warps=_NUM_WARPS,
                enable_fp_fusion=False,
            )


def _run(kernel, args: dict, *, grid: tuple[int, ...]) -> None:
    """One launch of ``kernel`` over ``grid`` with ``args`` (every parameter by name), handed
    over positionally in the kernel's parameter order ([Note: a launch's host cost])."""
    kernel.run(*[args[n] for n in kernel.arg_names], grid=grid, warmup=False, num_warps=_NUM_WARPS)


def _big(*sizes: int) -> bool:
    """Whether an offset can reach 2^31 (then the kernels index with int64)."""
    return max(sizes) + _BLOCK >= 2**31


def _aligned(t: torch.Tensor, spec: QuantSpec, *strides: int) -> bool:
    """Whether every payload of ``t`` (rows ``strides`` apart) starts on a scale-word boundary."""
    size = spec.scale_dtype.itemsize
    return t.data_ptr() % size == 0 and all(s % size == 0 for s in strides)


#: Whether the kernels run in Triton's interpreter: read once, when Triton and ``kernels`` read
#: it (their kernels are interpreted or compiled from import on), not per launch.
_INTERPRET = bool(K._INTERPRETED)


def _key(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def encode(
    src: torch.Tensor,
    *,
    spec: QuantSpec,
    out: torch.Tensor,
    ref: torch.Tensor | None,
    seed: int,
    step: int | torch.Tensor,
    stream: int,
    rotate: bool,
) -> None:
    """Write the payload of the contiguous 1-D ``src`` (minus ``ref``) into ``out`` (uint8);
    ``step`` an int or one int64 on the device, read by the kernel (as ``encode_rows``')."""
    numel = src.numel()
    if numel == 0:
        return
    on_device = isinstance(step, torch.Tensor)
    _encode_launch(
        src,
        spec=spec,
        out=out,
        numel=numel,
        seed=seed,
        step=0 if on_device else step,
        rotate=rotate,
        grid_rows=1,
        rng_stream=stream,
        ref_ptr=ref if ref is not None else src,
        x_row_stride=0,
        out_row_stride=0,
        skip_row=0,
        streams_ptr=src,
        step_ptr=step if on_device else src,
        STEP_PTR=on_device,
        HAS_REF=ref is not None,
        BIG=_big(numel, out.numel()),
        ALIGNED=_aligned(out, spec),
        MULTI=False,
    )


def encode_rows(
    rows: torch.Tensor,
    *,
    spec: QuantSpec,
    out: torch.Tensor,
    skip: int,
    streams: torch.Tensor,
    seed: int,
    step: int | torch.Tensor,
) -> None:
    """One launch: the payload of every row of ``rows`` (``[k, numel]``, unit column stride)
    but row ``skip`` (``k`` or more: none skipped), in order, into the rows of ``out``
    (``[k or k - 1, >= payload]`` uint8, unit column stride), row ``s`` with the noise stream
    ``streams[s]`` (int64 on the device); ``step`` an int or one int64 on the device, read by
    the kernel (a launch a CUDA graph replays)."""
    numel, slots = rows.shape[1], out.shape[0]
    if numel == 0 or slots == 0:
        return
    on_device = isinstance(step, torch.Tensor)
    _encode_launch(
        rows,
        spec=spec,
        out=out,
        numel=numel,
        seed=seed,
        step=0 if on_device else step,
        step_ptr=step if on_device else streams,
        STEP_PTR=on_device,
        rotate=True,
        grid_rows=slots,
        rng_stream=0,
        ref_ptr=rows,
        x_row_stride=rows.stride(0),
        out_row_stride=out.stride(0),
        skip_row=skip,
        streams_ptr=streams,
        HAS_REF=False,
        BIG=_big(rows.shape[0] * rows.stride(0), slots * out.stride(0)),
        ALIGNED=_aligned(out, spec, out.stride(0)),
        MULTI=True,
    )


def _encode_launch(
    x: torch.Tensor,
    *,
    spec: QuantSpec,
    out: torch.Tensor,
    numel: int,
    seed: int,
    step: int,
    rotate: bool,
    grid_rows: int,
    **rows: object,
) -> None:
    """``encode_kernel`` over ``numel`` elements per row; ``rows``: the arguments that say
    which rows (one, or ``MULTI``) and how they lie."""
    c = _consts(spec, rotate=rotate, block=_BLOCK)
    key0, key1 = _key(seed)
    kwargs = {
        **c.encoding,
        **_sizes(spec, numel),
        **rows,
        "x_ptr": x,
        "out_ptr": out,
        "signs_ptr": _signs_ptr(spec, x),
        "numel": numel,
        "key0": key0,
        "key1": key1,
        "step": step,
    }
    _launch(K.encode_kernel, kwargs, tile_numel=c.tile_numel, grid_rows=grid_rows)


def decode(
    payloads: torch.Tensor,
    *,
    numel: int,
    spec: QuantSpec,
    out: torch.Tensor,
    accumulate: bool,
    rotate: bool,
    separate: bool = False,
) -> None:
    """Sum of the decoded rows of ``payloads`` ([k, bytes] uint8) into (or onto) ``out``;
    with ``separate`` each row decodes into its own row of ``out`` ([k, numel]), one launch."""
    k = payloads.shape[0]
    _decode_launch(
        payloads,
        numel=numel,
        spec=spec,
        out=out,
        rotate=rotate,
        grid_rows=k if separate else 1,
        row_stride=payloads.stride(0) if separate else 0,
        out_row_stride=out.stride(0) if separate else 0,
        K=1 if separate else k,
        ACCUMULATE=accumulate,
        base_ptr=out,
        divisor=1.0,
        HAS_BASE=False,
        DIVIDE=False,
    )


def decode_sum_finish(
    payloads: torch.Tensor,
    *,
    numel: int,
    spec: QuantSpec,
    base: torch.Tensor,
    out: torch.Tensor,
    divisor: float | None,
) -> None:
    """One launch (two with a tail): ``out`` (``numel`` contiguous elements) gets ``(base +
    sum of the decoded rows of payloads) / divisor`` in ``out``'s dtype."""
    _decode_launch(
        payloads,
        numel=numel,
        spec=spec,
        out=out,
        rotate=True,
        grid_rows=1,
        row_stride=0,
        out_row_stride=0,
        K=payloads.shape[0],
        ACCUMULATE=False,
        base_ptr=base,
        divisor=1.0 if divisor is None else float(divisor),
        HAS_BASE=True,
        DIVIDE=divisor is not None,
    )


def _decode_launch(
    payloads: torch.Tensor,
    *,
    numel: int,
    spec: QuantSpec,
    out: torch.Tensor,
    rotate: bool,
    grid_rows: int,
    **how: object,
) -> None:
    """``decode_kernel`` over ``numel`` elements; ``how``: the rows and what the sum goes
    onto (``ACCUMULATE``, ``HAS_BASE``), and the division."""
    if numel == 0:
        return
    c = _consts(spec, rotate=rotate, block=_BLOCK)
    stride = payloads.stride(0)
    kwargs = {
        **c.decoding,
        **_sizes(spec, numel),
        **how,
        "in_ptr": payloads,
        "chunk_stride": stride,
        "out_ptr": out,
        "signs_ptr": _signs_ptr(spec, out),
        "numel": numel,
        "BIG": _big(numel, payloads.numel(), out.numel()),
        "INTERPRET": _INTERPRET,
        "ALIGNED": _aligned(payloads, spec, stride),
    }
    _launch(K.decode_kernel, kwargs, tile_numel=c.tile_numel, grid_rows=grid_rows)


def decode_sum_encode(
    payloads: torch.Tensor,
    *,
    numel: int,
    in_spec: QuantSpec,
    out_spec: QuantSpec,
    out: torch.Tensor,
    seed: int,
    step: int | torch.Tensor,
    stream: int,
) -> None:
    """Re-encode (``out_spec``) the float32 sum of the decoded rows of ``payloads`` into
    ``out``; ``step`` an int or one int64 on the device, read by the kernel (as ``encode``'s)."""
    if numel == 0:
        return
    on_device = isinstance(step, torch.Tensor)
    # Neither side rotates here: the sum stays in the Hadamard domain, tiles are whole groups.
    c_in = _consts(in_spec, rotate=False, block=_BLOCK)
    c_out = _consts(out_spec, rotate=False, block=_BLOCK)
    key0, key1 = _key(seed)
    n_groups = out_spec.num_groups(numel)
    kwargs = dict(
        in_ptr=payloads,
        chunk_stride=payloads.stride(0),
        out_ptr=out,
        numel=numel,
        in_scale_region=n_groups * in_spec.scale_bytes,
        in_code_bytes=in_spec.code_bytes(numel),
        out_scale_region=n_groups * out_spec.scale_bytes,
        out_code_bytes=out_spec.code_bytes(numel),
        n_groups=n_groups,
        key0=key0,
        key1=key1,
        rng_stream=stream,
        step=0 if on_device else step,
        step_ptr=step if on_device else payloads,
        STEP_PTR=on_device,
        **c_in.in_codes,
        **c_out.tile,
        **c_out.codes,
        **c_out.quantize,
        K=payloads.shape[0],
        BIG=_big(numel, payloads.numel(), out.numel()),
        IN_ALIGNED=_aligned(payloads, in_spec, payloads.stride(0)),
        ALIGNED=_aligned(out, out_spec),
    )
    _launch(K.decode_sum_encode_kernel, kwargs, tile_numel=c_out.tile_numel)


def global_int_encode(
    src: torch.Tensor,
    *,
    scales: torch.Tensor,
    out: torch.Tensor,
    levels: int,
    group_size: int,
    stochastic: bool,
    seed: int,
    step: int,
    stream: int,
) -> None:
    """Global-QSGD codes of the contiguous 1-D ``src`` into ``out`` (the carrier dtype)."""
    numel = src.numel()
    key0, key1 = _key(seed)
    rows = _rows(group_size, _BLOCK)
    kwargs = dict(
        x_ptr=src,
        scale_ptr=scales,
        out_ptr=out,
        numel=numel,
        n_groups=scales.numel(),
        levels=levels,
        key0=key0,
        key1=key1,
        rng_stream=stream,
        step=step,
        ROWS=rows,
        GROUP=group_size,
        STOCHASTIC=stochastic,
        BIG=_big(numel),
    )
    _launch(K.global_int_encode_kernel, kwargs, tile_numel=rows * group_size)


#: Columns per program of ``run_flags_kernel``.
_FLAG_BLOCK = 2048


def run_flags(rows: torch.Tensor, *, ends: torch.Tensor, flags: torch.Tensor, limit: float) -> None:
    """Set ``flags[p]`` (int32, zeroed) where run ``p`` of any row of ``rows`` (``[k, numel]``,
    unit column stride) holds a value not ``|x| <= limit``; ``ends`` (int64, on the device) are
    the runs' cumulative ends. One launch."""
    k, numel = rows.shape
    if k == 0 or numel == 0:
        return
    runs = ends.numel()
    args = {
        "x_ptr": rows,
        "ends_ptr": ends,
        "flags_ptr": flags,
        "numel": numel,
        "row_stride": rows.stride(0),
        "n_runs": runs,
        "limit": limit,
        "BLOCK": _FLAG_BLOCK,
        "SEARCH": max(1, runs.bit_length()),
        "BIG": _big(k * rows.stride(0), numel),
    }
    _run(K.run_flags_kernel, args, grid=(-(-numel // _FLAG_BLOCK), k))


#: Elements per program of ``row_sum_kernel``.
_ROW_SUM_BLOCK = 1024


def row_sum(
    rows: torch.Tensor,
    *,
    base: torch.Tensor,
    out: torch.Tensor,
    ends: torch.Tensor,
    starts: torch.Tensor,
    divisor: float | None,
) -> None:
    """One launch: ``out`` at the runs (cumulative ``ends``, output ``starts``; int64 on the
    device) gets ``(base + sum of rows) / divisor``."""
    k, numel = rows.shape
    if numel == 0:
        return
    runs = ends.numel()
    args = {
        "rows_ptr": rows,
        "base_ptr": base,
        "out_ptr": out,
        "ends_ptr": ends,
        "starts_ptr": starts,
        "numel": numel,
        "row_stride": rows.stride(0) if k else 0,
        "n_runs": runs,
        "divisor": 1.0 if divisor is None else float(divisor),
        "K": k,
        "DIVIDE": divisor is not None,
        "BLOCK": _ROW_SUM_BLOCK,
        "SEARCH": max(1, runs.bit_length()),
        "INTERPRET": _INTERPRET,
    }
    _run(K.row_sum_kernel, args, grid=(-(-numel // _ROW_SUM_BLOCK),))


#: Elements per program of ``zero_flagged_kernel`` (a program reads one flag word: few
#: programs keep the unflagged pass, the usual one, short).
_ZERO_BLOCK = 8192
#: The integer dtype of each element size: the kernel writes zero bits through it (every float
#: format's +0.0, and no bf16 in the interpreter's numpy).
_BITS_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def zero_flagged(x: torch.Tensor, *, flag: torch.Tensor) -> None:
    """One launch: the contiguous ``x`` zeroed where the one-word ``flag`` (int32 or uint8, on
    its device) is set."""
    numel = x.numel()
    if numel == 0:
        return
    args = {
        "x_ptr": x.view(_BITS_OF[x.element_size()]),
        "flag_ptr": flag,
        "numel": numel,
        "BLOCK": _ZERO_BLOCK,
        "BIG": _big(numel),
    }
    _run(K.zero_flagged_kernel, args, grid=(-(-numel // _ZERO_BLOCK),))


def zero_flagged_each(
    xs: Sequence[torch.Tensor], *, flags: torch.Tensor, which: Sequence[int]
) -> None:
    """One launch per element size among ``xs`` (contiguous, on one device, none empty): each
    ``xs[j]`` zeroed where ``flags[which[j]]`` (int32 or uint8) is set; the tables (where each
    tensor lies, its flag's index, the grid) built once per layout ([Note: one launch per group]
    in ``qsdp.runtime._adam_triton``)."""
    device = xs[0].device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    by_size: dict[int, list[int]] = {}
    for j, x in enumerate(xs):
        by_size.setdefault(x.element_size(), []).append(j)
    for size, picked in by_size.items():
        chosen = [xs[j] for j in picked]  # (one element size: whole elements apart)
        numels = tuple(x.numel() for x in chosen)
        layout = tables.layout_of([chosen], numels, aligned_sets=0, what="zero_flagged_each")
        grid = tables.programs(device, stream, numels, block=_ZERO_BLOCK)
        rel = tables.offsets(device, stream, (layout.rel[0], tuple(which[j] for j in picked)))
        args = {
            "x_ptr": chosen[0].view(_BITS_OF[size]),  # (the others reached from it)
            "flags_ptr": flags,
            "rel_ptr": rel,
            "numel_ptr": grid.numel,
            "param_ptr": grid.param,
            "first_ptr": grid.first,
            "k": len(picked),
            "BLOCK": _ZERO_BLOCK,
        }
        _run(K.zero_flagged_each_kernel, args, grid=(grid.programs,))
