"""Global-QSGD's integer quantizer: codes whose plain integer sum over ranks is exact.

[Note: the level rule]
Every rank scales a group by the same global ``M`` (the MAX all-reduce of the group's local
max-abs) and rounds ``x * s / M`` to an integer in ``[-s, s]``. With ``s = floor(L / n)`` levels,
where ``L`` is the largest integer the carrier sums exactly (127 for int8, 2048 for an fp16
carrier, 2^31 - 1 for int32), any sum over ``n`` ranks stays within ``[-L, L]``, so a plain
NCCL/gloo SUM all-reduce or reduce-scatter on the carrier never wraps. The mean is then
``sum(q) * M / (s * n)``. With stochastic rounding every code is unbiased, so is the mean, as
long as float32 resolves the fraction that is rounded: at the int32 carrier's cap of 2^24
levels it no longer does (``x * s / M`` has no fractional bits left near the group maximum),
and ``benchmarks/global_qsgd_scaling.py`` measures a bias of the order of the rounding noise
there, about 1e-7 of the result; int8 and fp16 carriers are unbiased within its statistics.

Tiny groups: encode and decode both use ``M' = max(M, s * 2^-126)``, so the step ``M' / s`` is
at least float32's smallest normal number and ``s / M'`` is finite (``qsdp.quant.reference``,
[Note: step floor]). Per rank and element the error is then at most ``max(M / s, 2^-126) / 2``
(nearest) or below ``max(M / s, 2^-126)`` (stochastic, unbiased). Without it, ``s / M``
overflowed for ``M < s * 2^-128`` (int8 at two ranks: ``M < 1.9e-37``; int32's 2^24 levels:
``M < 4.9e-32``) and ``0 * inf`` became a NaN code (INT_MIN in an int32 carrier).
"""

from __future__ import annotations

import torch

from .codec import Backend, _resolve
from .philox import uniform
from .reference import _div
from .spec import STEP_FLOOR, Rounding

__all__ = [
    "CARRIERS",
    "global_int_decode",
    "global_int_encode",
    "global_int_levels",
    "group_absmax",
]

#: carrier name -> (dtype, largest exactly summable integer L)
CARRIERS: dict[str, tuple[torch.dtype, int]] = {
    "int8": (torch.int8, 127),
    "fp16": (torch.float16, 2048),
    "int32": (torch.int32, 2**31 - 1),
}


def _carrier(carrier: str) -> tuple[torch.dtype, int]:
    if carrier not in CARRIERS:
        raise ValueError(f"carrier={carrier!r} must be one of {sorted(CARRIERS)}")
    return CARRIERS[carrier]


#: Codes are rounded in float32, exact for integers up to 2^24: more levels would round up and
#: wrap the carrier (an int32 carrier with few ranks), so the level count is capped there.
FLOAT32_EXACT = 2**24


def global_int_levels(carrier: str, world_size: int) -> int:
    """Levels ``s = min(floor(L / n), 2^24)`` for ``world_size`` ranks summing on ``carrier``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    _, limit = _carrier(carrier)
    levels = min(limit // world_size, FLOAT32_EXACT)
    if levels < 1:
        raise ValueError(
            f"carrier={carrier!r} sums at most {limit} exactly: {world_size} ranks leave no "
            "quantization level; use carrier='fp16' (2048) or 'int32'"
        )
    return levels


def group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 max-abs of each ``group_size`` run of flattened ``x`` (last group may be short).

    All ranks MAX-all-reduce this to get the shared scale ``M``. A group holding NaN or Inf gets
    ``+inf``, which survives the MAX on every backend, so every rank sees it and raises in
    :func:`global_int_encode`.
    """
    return rows_group_absmax(x.reshape(1, -1), group_size)[0]


def rows_group_absmax(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """:func:`group_absmax` of each row of ``rows`` (``[k, m]``), ``[k, groups]``, in one pass
    over all rows (a reduce-scatter's ``n`` chunks: a handful of ops, not a handful per
    chunk)."""
    k, m = rows.shape
    ng = -(-m // group_size)
    if m == ng * group_size:
        amax = rows.reshape(k, ng, group_size).abs().amax(dim=2).float()
    else:
        padded = torch.zeros(k, ng * group_size, dtype=torch.float32, device=rows.device)
        padded[:, :m] = rows.abs()
        amax = padded.view(k, ng, group_size).amax(dim=2)
    return torch.where(torch.isnan(amax), float("inf"), amax)


def _per_element(scales: torch.Tensor, n: int, group_size: int) -> torch.Tensor:
    return scales.float().repeat_interleave(group_size)[:n]


def _floored(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """``M' = max(M, levels * 2^-126)`` per group, float32 (a NaN ``M`` stays NaN): the step
    ``M' / levels`` is never below 2^-126 ([Note: step floor] in ``qsdp.quant.reference``)."""
    scales = scales.reshape(-1).float()
    # a Python float, which torch rounds to float32 here: float32(levels) * 2^-126, the
    # kernel's value (scaling by a power of two commutes with the rounding)
    floor = float(levels) * STEP_FLOOR
    return torch.where(scales < floor, floor, scales)


def nonfinite_mode(nonfinite: str) -> str:
    """``nonfinite`` checked: ``"raise"`` or ``"propagate"`` (the integer path's choice)."""
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    return nonfinite


def global_int_encode(
    x: torch.Tensor,
    scales: torch.Tensor,
    levels: int,
    *,
    carrier: str = "int8",
    group_size: int = 128,
    rounding: Rounding | str = Rounding.STOCHASTIC,
    seed: int = 0,
    step: int = 0,
    stream: int = 0,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
    nonfinite: str = "raise",
) -> torch.Tensor:
    """Integer codes of ``x`` (flattened, in the carrier's dtype) against the global ``scales``.

    ``q = clamp(r(x * (levels / M')), -levels, levels)`` per element, ``r`` the rounding
    (``floor(v + u)`` with the noise of :func:`qsdp.quant.philox.uniform`, or ``floor(v + 0.5)``),
    ``M' = max(M, levels * 2^-126)`` (so the step ``M' / levels`` is at least 2^-126).

    Args:
        x: the local tensor (float32, bfloat16 or float16).
        scales: float32 global max-abs per group, at least the local one (the MAX all-reduce of
            :func:`group_absmax`): then a NaN/Inf in ``x`` shows as a non-finite scale.
        levels: from :func:`global_int_levels` for the carrier and world size.
        rounding: ``stochastic`` (unbiased, the default) or ``nearest``.
        seed, step, stream: noise key; give each rank its own ``stream``.
        out: optional contiguous tensor of the carrier's dtype and ``x.numel()`` elements.
        backend: ``"auto"`` (Triton on CUDA), ``"reference"`` or ``"triton"``; the Triton kernel
            needs a power-of-two ``group_size`` from 16 to 8192.

        nonfinite: ``"raise"`` (read the scales on the host, raise on a non-finite one) or
            ``"propagate"`` (no sync; such a group decodes to NaN/Inf).

    Raises:
        ValueError: a non-finite scale (NaN/Inf in some rank's group, with ``"raise"``), bad
            levels or shapes.
    """
    dtype, limit = _carrier(carrier)
    if not 1 <= levels <= limit:
        raise ValueError(f"levels={levels} must be in [1, {limit}] for carrier={carrier!r}")
    rounding = Rounding(rounding)
    n = x.numel()
    ng = -(-n // group_size)
    if scales.numel() != ng:
        raise ValueError(
            f"scales has {scales.numel()} groups; {n} elements in groups of {group_size} need {ng}"
        )
    if out is None:
        out = torch.empty(n, dtype=dtype, device=x.device)
    elif out.dtype != dtype or out.numel() != n or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {n} elements; got {out.dtype=} "
            f"{tuple(out.shape)=}"
        )
    nonfinite_mode(nonfinite)
    # "raise" reads the scales on the host (a sync); "propagate" leaves a non-finite group's
    # codes undefined and its decoded values NaN/Inf (M = inf), for callers that check first
    bad = int((~torch.isfinite(scales)).sum()) if nonfinite == "raise" else 0
    if bad:
        raise ValueError(
            f"cannot quantize: {bad} of {ng} groups hold NaN or Inf (a non-finite scale); fix the "
            "source (a diverging loss, a missing grad clip) before the integer all-reduce"
        )
    if n == 0:
        return out
    flat = x.reshape(-1)
    scales = scales.reshape(-1).float().contiguous()
    if _resolve(backend, x.device) == "triton":
        g = group_size
        if g < 16 or g > 8192 or g & (g - 1):
            raise ValueError(
                f"group_size={g}: the Triton kernel needs a power of two from 16 to 8192; use "
                "128, or backend='reference'"
            )
        from ._triton import launch

        launch.global_int_encode(
            flat.contiguous(),
            scales=scales,
            out=out.view(-1),
            levels=levels,
            group_size=g,
            stochastic=rounding is Rounding.STOCHASTIC,
            seed=seed,
            step=step,
            stream=stream,
        )
        return out
    m = _per_element(_floored(scales, levels), n, group_size)
    inv = torch.where(m > 0, _div(float(levels), m), 0.0)
    v = flat.float() * inv
    if rounding is Rounding.STOCHASTIC:
        q = torch.floor(v + uniform(n, seed=seed, step=step, stream=stream, device=flat.device))
    else:
        q = torch.floor(v + 0.5)
    out.view(-1).copy_(q.clamp(-levels, levels).to(dtype))
    return out


def global_int_decode(
    summed: torch.Tensor,
    scales: torch.Tensor,
    levels: int,
    *,
    world_size: int,
    group_size: int = 128,
    op: str = "avg",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values of summed codes: ``(sum(q) / s) * M'``, with ``sum(q) / s`` divided by
    ``world_size`` first for ``op="avg"`` and ``M' = max(M, s * 2^-126)`` as in
    :func:`global_int_encode`.

    The code ratio is formed before the multiply by ``M``: for ``"avg"`` it lies in ``[-1, 1]``,
    so the mean never overflows, even with ``M`` at float32's maximum (``sum(q) * M`` would pass
    it with two ranks). ``"sum"`` overflows to ``inf`` only where the sum itself leaves
    float32's range, as any float32 sum does.

    Args:
        summed: the SUM all-reduced codes (any dtype holding integers).
        scales: float32 global max-abs ``M`` per group (as given to :func:`global_int_encode`).
        levels: ``s``, as given to :func:`global_int_encode`.
        world_size: ranks whose codes were summed.
        group_size: elements per scale.
        op: ``"avg"`` or ``"sum"``.
        dtype: dtype of the result.

    Returns:
        A 1-D tensor of ``summed.numel()`` values.
    """
    if op not in ("avg", "sum"):
        raise ValueError(f"op={op!r} must be 'avg' or 'sum'")
    n = summed.numel()
    m = _per_element(_floored(scales, levels), n, group_size)
    ratio = _div(summed.reshape(-1).float(), float(levels))
    if op == "avg":
        ratio = _div(ratio, float(world_size))
    return (ratio * m).to(dtype)
