"""Shared inputs and bounds for the quantizer tests."""

from __future__ import annotations

import itertools

import torch

from qsdp.quant import QuantSpec, Scheme

# Every scheme at 2, 4 and 8 bits, both roundings, with and without a Hadamard block of 16, in
# groups of G: the cases the tiny-value and overflow tests sweep, on both backends.
G = 32
BACKENDS = ["reference", "triton"]
CASES = list(
    itertools.product(
        ("absmax", "minmax", "shift-lattice"), (2, 4, 8), ("nearest", "stochastic"), (None, 16)
    )
)
IDS = [f"{s}{b}-{r}-h{h}" for s, b, r, h in CASES]


def case_spec(scheme, bits, rounding, had, group=G, **kw) -> QuantSpec:
    """The :class:`QuantSpec` of one of :data:`CASES`."""
    return QuantSpec(bits, group, scheme, rounding, hadamard_block=had, **kw)


# Odd lengths: shorter than a group, a group plus a tail, many groups plus a tail.
ODD_SIZES = (1, 37, 1000, 4096 + 13)


def heavy_tailed(n: int, *, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Gaussian with rare large outliers: the shape of real LLM gradients."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    spikes = torch.rand(n, generator=g) < 0.01
    x = torch.where(spikes, x * 50.0, x)
    return x.to(dtype)


def group_steps(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-element quantization step of ``spec`` for float32 ``x`` (rotated domain if any)."""
    n, g = x.numel(), spec.group_size
    ng = spec.num_groups(n)
    pad_lo = torch.full((ng * g,), float("inf"))
    pad_hi = torch.full((ng * g,), -float("inf"))
    pad_lo[:n] = x
    pad_hi[:n] = x
    lo = pad_lo.reshape(ng, g).amin(1)
    hi = pad_hi.reshape(ng, g).amax(1)
    if spec.scheme is Scheme.ABSMAX:
        step = torch.maximum(lo.abs(), hi.abs()) / spec.qmax
    elif spec.scheme is Scheme.MINMAX:
        step = (hi - lo) / spec.max_code
    else:
        step = (hi - lo) / (spec.max_code - 1)
    return step.repeat_interleave(g)[:n]
