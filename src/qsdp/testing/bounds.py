"""Error bounds of the quantizers, for checking compressed collectives against exact ones.

A quantizer with step ``s`` (per group) is off by at most ``s / 2`` per element with nearest
rounding and by less than ``s`` with stochastic rounding, where ``s`` is floored at
``STEP_FLOOR = 2^-126`` (``qsdp.quant.reference``, [Note: step floor]): the bound is
``max(step, 2^-126) / 2`` (nearest) or ``max(step, 2^-126)``, for every finite input, tiny and
subnormal ones included. With a Hadamard rotation the step and the bound live in the rotated
domain: the error of a sum of payloads ``out - exact`` satisfies ``|H (out - exact)| <= sum of
the per-payload bounds`` element by element (``H`` is linear), so checks rotate the error rather
than the bound.
"""

from __future__ import annotations

import math

import torch

from ..quant import QuantSpec
from ..quant.hadamard import hadamard_forward
from ..quant.spec import STEP_FLOOR, Rounding, Scheme

__all__ = ["assert_within", "dtype_slack", "quant_steps", "rounding_bound", "to_quant_domain"]


def to_quant_domain(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``v`` flattened in float64, Hadamard-rotated as ``spec`` rotates before quantizing."""
    flat = v.reshape(-1).double()
    return hadamard_forward(flat, spec) if spec.hadamard_block else flat


def quant_steps(x: torch.Tensor, spec: QuantSpec, *, rotated: bool = False) -> torch.Tensor:
    """Float64 quantization step of each element's group when ``x`` is encoded with ``spec``,
    floored at ``STEP_FLOOR`` (2^-126; the floor is loose for a constant group, which decodes
    exactly).

    Args:
        x: the tensor as handed to ``encode`` (any shape; groups run over the flattened tensor).
        spec: the quantizer.
        rotated: ``x`` is already in the quantizer's (Hadamard) domain, as the middle hop of the
            two-level reduce-scatter re-encodes it.

    Returns:
        1-D float64 tensor of ``x.numel()`` steps.
    """
    v = x.reshape(-1).double() if rotated else to_quant_domain(x, spec)
    n, g = v.numel(), spec.group_size
    ng = spec.num_groups(n)
    pad = torch.full((ng * g - n,), float("nan"), dtype=torch.float64)
    groups = torch.cat((v, pad)).reshape(ng, g)
    if spec.scheme is Scheme.ABSMAX:
        step = groups.abs().nan_to_num(0.0).amax(dim=1) / spec.qmax
        if spec.scale_dtype == torch.bfloat16:
            step = step * (1 + 2.0**-7)  # scales are rounded up to bfloat16
    else:
        hi = groups.nan_to_num(-math.inf).amax(dim=1)
        lo = groups.nan_to_num(math.inf).amin(dim=1)
        levels = spec.max_code if spec.scheme is Scheme.MINMAX else spec.max_code - 1
        step = (hi - lo) / levels
    step = step.clamp(min=STEP_FLOOR)
    return step.repeat_interleave(g)[:n]


def rounding_bound(x: torch.Tensor, spec: QuantSpec, *, rotated: bool = False) -> torch.Tensor:
    """Per-element bound of ``|decode(encode(x)) - x|`` (in the quantizer's domain), float64:
    ``step / 2`` for nearest rounding, ``step`` for stochastic rounding."""
    step = quant_steps(x, spec, rotated=rotated)
    return step * (0.5 if spec.rounding is Rounding.NEAREST else 1.0)


def dtype_slack(
    magnitude: torch.Tensor, dtype: torch.dtype, spec: QuantSpec | None
) -> torch.Tensor:
    """Slack for float32 arithmetic and the final rounding to ``dtype``, float64 per element.

    Relative to ``magnitude``, plus the absolute rounding below each format's normal range
    (float32: multiples of 2^-149; ``dtype``: half its smallest subnormal), which tiny and
    subnormal values meet.

    Args:
        magnitude: per-element scale of the values involved (e.g. the sum of the inputs' absolute
            values), original domain.
        dtype: the output dtype.
        spec: the quantizer (its Hadamard block spreads a rounding error over the block).
    """
    info = torch.finfo(dtype)
    eps = 4 * 2.0**-24 + info.eps / 2
    tiny = 4 * 2.0**-149 + info.smallest_normal * info.eps / 2
    mag = magnitude.reshape(-1).double() * eps + tiny
    if spec is not None and spec.hadamard_block:
        h = spec.hadamard_block
        n = mag.numel() // h * h
        block = mag[:n].reshape(-1, h).amax(dim=1, keepdim=True) * math.sqrt(h)
        mag = torch.cat((block.expand(-1, h).reshape(-1), mag[n:]))
    return mag


def assert_within(
    err: torch.Tensor,
    bound: torch.Tensor,
    spec: QuantSpec,
    *,
    slack: torch.Tensor | float = 0.0,
    what: str = "error",
) -> None:
    """Assert ``|rotate(err)| <= bound + slack`` element by element.

    Args:
        err: ``out - exact`` in the original domain.
        bound: per-element bound in the quantizer's domain (sum of :func:`rounding_bound` terms).
        spec: the quantizer whose Hadamard rotation defines the domain.
        slack: extra tolerance (see :func:`dtype_slack`).
        what: name used in the failure message.

    Raises:
        AssertionError: naming the number of violations and the worst element.
    """
    rot = to_quant_domain(err, spec).abs()
    excess = rot - bound.reshape(-1).double() - slack
    bad = excess > 0
    if bool(bad.any()):
        i = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {rot.numel()} elements exceed the bound; worst at "
            f"{i}: |err|={float(rot[i]):.6g} bound={float(bound.reshape(-1)[i]):.6g} ({spec})"
        )
