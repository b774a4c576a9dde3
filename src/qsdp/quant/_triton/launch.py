"""Launchers of the Triton quantizer kernels: shapes, grids and constexpr flags."""

from __future__ import annotations

import functools
import os

import torch

from ..philox import random_signs
from ..reference import headroom, step_cap
from ..spec import QuantSpec, Rounding, Scheme, inv_sqrt
from . import kernels as K

_SCHEME_ID = {Scheme.ABSMAX: 0, Scheme.MINMAX: 1, Scheme.SHIFT_LATTICE: 2}
#: Elements per program; a program always holds whole groups.
_BLOCK = 4096
_NUM_WARPS = 4


def _rows(group_size: int) -> int:
    """Groups per program: whole groups filling about ``_BLOCK`` elements."""
    return max(1, _BLOCK // group_size)


@functools.lru_cache(maxsize=64)
def _signs(h: int, seed: int, device: torch.device) -> torch.Tensor:
    return random_signs(h, seed, device=device)


def _had_args(spec: QuantSpec, device: torch.device) -> dict:
    h = spec.hadamard_block or 16
    signs = _signs(h, spec.hadamard_seed, device) if spec.hadamard_seed is not None else None
    return {
        "signs": signs,
        "inv_sqrt_h": inv_sqrt(h),
        "H": h,
        "LOG_H": h.bit_length() - 1,
        "HAS_SIGNS": signs is not None,
    }


def _range_args(spec: QuantSpec) -> dict:
    """The representable-range constants of the quantizing kernels (reference's
    [Note: representable range])."""
    return {"STEP_CAP": step_cap(spec), "HEADROOM": headroom(spec)}


def _hb(spec: QuantSpec, rotate: bool) -> int:
    """Innermost tile length: the Hadamard block when the kernel rotates, else the group."""
    return spec.hadamard_block if spec.hadamard_block and rotate else spec.group_size


def _launch(kernel, group_size: int, numel: int, *args, rows: int = 1, **meta) -> None:
    """Launch the mask-free main grid over whole tiles, then one TAIL program for the rest
    (``rows`` independent rows on grid axis 1, for the kernels that take them)."""
    tile = _rows(group_size) * group_size
    whole, rest = divmod(numel, tile)
    if whole:
        kernel[(whole, rows)](*args, 0, TAIL=False, **meta)
    if rest:
        kernel[(1, rows)](*args, whole, TAIL=True, **meta)


def _big(*sizes: int) -> bool:
    """Whether an offset can reach 2^31 (then the kernels index with int64)."""
    return max(sizes) + _BLOCK >= 2**31


def _aligned(t: torch.Tensor, spec: QuantSpec, *strides: int) -> bool:
    """Whether every payload of ``t`` (rows ``strides`` apart) starts on a scale-word boundary."""
    size = spec.scale_dtype.itemsize
    return t.data_ptr() % size == 0 and all(s % size == 0 for s in strides)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _key(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def encode(
    src: torch.Tensor,
    spec: QuantSpec,
    out: torch.Tensor,
    *,
    ref: torch.Tensor | None,
    seed: int,
    step: int,
    stream: int,
    rotate: bool,
) -> None:
    """Write the payload of the contiguous 1-D ``src`` (minus ``ref``) into ``out`` (uint8)."""
    numel = src.numel()
    if numel == 0:
        return
    had = _had_args(spec, src.device)
    key0, key1 = _key(seed)
    _launch(
        K.encode_kernel,
        spec.group_size,
        numel,
        src,
        ref if ref is not None else src,
        out,
        had["signs"] if had["HAS_SIGNS"] else src,
        numel,
        spec.num_groups(numel) * spec.scale_bytes,
        spec.code_bytes(numel),
        spec.num_groups(numel),
        key0,
        key1,
        stream,
        step,
        had["inv_sqrt_h"],
        BITS=spec.bits,
        ROWS=_rows(spec.group_size),
        GPB=spec.group_size // _hb(spec, rotate),
        HB=_hb(spec, rotate),
        SCHEME=_SCHEME_ID[spec.scheme],
        STOCHASTIC=spec.rounding is Rounding.STOCHASTIC,
        SCALE_BF16=spec.scale_dtype == torch.bfloat16,
        **_range_args(spec),
        HAS_REF=ref is not None,
        ROTATE=bool(spec.hadamard_block) and rotate,
        HAS_SIGNS=had["HAS_SIGNS"],
        LOG_H=had["LOG_H"],
        BIG=_big(numel, out.numel()),
        ALIGNED=_aligned(out, spec),
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,
    )


def decode(
    payloads: torch.Tensor,
    numel: int,
    spec: QuantSpec,
    out: torch.Tensor,
    *,
    accumulate: bool,
    rotate: bool,
    separate: bool = False,
) -> None:
    """Sum of the decoded rows of ``payloads`` ([k, bytes] uint8) into (or onto) ``out``;
    with ``separate`` each row decodes into its own row of ``out`` ([k, numel]), one launch."""
    if numel == 0:
        return
    had = _had_args(spec, out.device)
    k = payloads.shape[0]
    rows = k if separate else 1
    _launch(
        K.decode_kernel,
        spec.group_size,
        numel,
        payloads,
        payloads.stride(0),
        out,
        had["signs"] if had["HAS_SIGNS"] else out,
        numel,
        spec.num_groups(numel) * spec.scale_bytes,
        spec.code_bytes(numel),
        spec.num_groups(numel),
        had["inv_sqrt_h"],
        payloads.stride(0) if separate else 0,
        out.stride(0) if separate else 0,
        rows=rows,
        BITS=spec.bits,
        ROWS=_rows(spec.group_size),
        GPB=spec.group_size // _hb(spec, rotate),
        HB=_hb(spec, rotate),
        SCHEME=_SCHEME_ID[spec.scheme],
        SCALE_BF16=spec.scale_dtype == torch.bfloat16,
        K=1 if separate else k,
        ACCUMULATE=accumulate,
        ROTATE=bool(spec.hadamard_block) and rotate,
        HAS_SIGNS=had["HAS_SIGNS"],
        LOG_H=had["LOG_H"],
        BIG=_big(numel, payloads.numel(), out.numel()),
        INTERPRET=_interpret(),
        ALIGNED=_aligned(payloads, spec, payloads.stride(0)),
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,
    )


def decode_sum_encode(
    payloads: torch.Tensor,
    numel: int,
    in_spec: QuantSpec,
    out_spec: QuantSpec,
    out: torch.Tensor,
    *,
    seed: int,
    step: int,
    stream: int,
) -> None:
    """Re-encode (``out_spec``) the float32 sum of the decoded rows of ``payloads`` into ``out``."""
    if numel == 0:
        return
    key0, key1 = _key(seed)
    ng = out_spec.num_groups(numel)
    _launch(
        K.decode_sum_encode_kernel,
        out_spec.group_size,
        numel,
        payloads,
        payloads.stride(0),
        out,
        numel,
        ng * in_spec.scale_bytes,
        in_spec.code_bytes(numel),
        ng * out_spec.scale_bytes,
        out_spec.code_bytes(numel),
        ng,
        key0,
        key1,
        stream,
        step,
        IN_BITS=in_spec.bits,
        IN_SCHEME=_SCHEME_ID[in_spec.scheme],
        IN_SCALE_BF16=in_spec.scale_dtype == torch.bfloat16,
        BITS=out_spec.bits,
        ROWS=_rows(out_spec.group_size),
        GPB=1,
        HB=out_spec.group_size,
        SCHEME=_SCHEME_ID[out_spec.scheme],
        STOCHASTIC=out_spec.rounding is Rounding.STOCHASTIC,
        SCALE_BF16=out_spec.scale_dtype == torch.bfloat16,
        **_range_args(out_spec),
        K=payloads.shape[0],
        BIG=_big(numel, payloads.numel(), out.numel()),
        IN_ALIGNED=_aligned(payloads, in_spec, payloads.stride(0)),
        ALIGNED=_aligned(out, out_spec),
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,
    )


def global_int_encode(
    src: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    levels: int,
    *,
    group_size: int,
    stochastic: bool,
    seed: int,
    step: int,
    stream: int,
) -> None:
    """Global-QSGD codes of the contiguous 1-D ``src`` into ``out`` (the carrier dtype)."""
    numel = src.numel()
    key0, key1 = _key(seed)
    _launch(
        K.global_int_encode_kernel,
        group_size,
        numel,
        src,
        scales,
        out,
        numel,
        scales.numel(),
        levels,
        key0,
        key1,
        stream,
        step,
        ROWS=_rows(group_size),
        GROUP=group_size,
        STOCHASTIC=stochastic,
        BIG=_big(numel),
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,
    )
