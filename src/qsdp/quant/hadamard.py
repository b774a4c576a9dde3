"""Blockwise orthonormal Hadamard rotation (SDP4Bit's smoothing): the reference of both backends.

[Note: why butterflies]
``H_h / sqrt(h)`` is applied as the fast Walsh-Hadamard transform: ``log2(h)`` stages, stage
``s = 1, 2, 4, ..., h/2`` replacing each pair ``(x[i], x[i + s])`` inside a ``2s`` block by
``(a + b, a - b)``, then one multiply by the float32 constant ``1/sqrt(h)``. The Triton kernels do
the same float32 operations in the same order, so both backends produce bit-identical codes.
The transform is its own inverse (``H`` is symmetric and orthonormal); with a sign vector ``d``
the forward map is ``H (d * x)`` and the inverse ``d * (H y)``. It is linear, so the sum of
rotated vectors is the rotation of the sum: reductions can run in the rotated domain. Only whole
blocks of the flattened tensor are rotated; a tail shorter than ``h`` passes unchanged.
The butterflies' partial sums reach ``h`` times the largest input before the multiply by
``1/sqrt(h)``: a forward overflow shows as a non-finite rotated value (encode flags its group),
and encode keeps a headroom of ``2h`` on every decoded group so the inverse cannot overflow
(``reference.py``, [Note: representable range]).
"""

from __future__ import annotations

import torch

from .philox import random_signs
from .spec import QuantSpec, inv_sqrt

__all__ = ["fwht", "hadamard_forward", "hadamard_inverse"]


def fwht(rows: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each row of a float32 ``[m, h]`` tensor."""
    m, h = rows.shape
    y = rows
    s = 1
    while s < h:
        v = y.reshape(m, h // (2 * s), 2, s)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(m, h)
        s *= 2
    return y


def _signs(spec: QuantSpec, device) -> torch.Tensor | None:
    if spec.hadamard_seed is None:
        return None
    return random_signs(spec.hadamard_block, spec.hadamard_seed, device=device)


def _whole_blocks(flat: torch.Tensor, h: int) -> int:
    return flat.numel() // h * h


def hadamard_forward(flat: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Rotate the whole ``spec.hadamard_block`` blocks of a float32 1-D tensor (new tensor)."""
    h = spec.hadamard_block
    n = _whole_blocks(flat, h)
    out = flat.clone()
    if n == 0:
        return out
    rows = flat[:n].reshape(-1, h)
    signs = _signs(spec, flat.device)
    if signs is not None:
        rows = rows * signs
    out[:n] = (fwht(rows) * inv_sqrt(h)).reshape(-1)
    return out


def hadamard_inverse(flat: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Undo :func:`hadamard_forward` on a float32 1-D tensor (new tensor)."""
    h = spec.hadamard_block
    n = _whole_blocks(flat, h)
    out = flat.clone()
    if n == 0:
        return out
    rows = fwht(flat[:n].reshape(-1, h)) * inv_sqrt(h)
    signs = _signs(spec, flat.device)
    if signs is not None:
        rows = rows * signs
    out[:n] = rows.reshape(-1)
    return out
