"""Counter-based random numbers (Philox4x32-10) in plain torch: the spec of the Triton generator.

[Note: reproducible noise]
Stochastic rounding needs noise that is (a) the same on every run, backend and device for the
same inputs, (b) independent between ranks, steps and tensors, and (c) cheap to make inside a
kernel without state. Philox4x32-10 (Salmon et al., SC'11) maps a 128-bit counter and a 64-bit
key to four 32-bit words. qsdp uses

    key     = seed (64 bits)
    counter = (element_index // 8 low word, element_index // 8 high word, stream, step)

and feeds eight elements from one call (16 bits each, see :func:`uniform`; exact in float32).
``stream`` separates ranks and buffers (callers pass e.g. ``rank`` or a hash of (rank, bucket)),
``step`` separates iterations. Here every 32-bit word is
held in an int64 tensor, and no int64 product overflows (see :func:`_mulhilo`): the result is
bit-identical to the Triton kernels' uint32 arithmetic on any device.
"""

from __future__ import annotations

import torch

__all__ = ["group_uniform", "philox4x32", "philox_rounds", "random_signs", "uniform"]

_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_MASK = 0xFFFFFFFF
_ROUNDS = 10

#: Stream reserved for the shift-lattice dither (shared by all ranks, so not a rank's stream).
LATTICE_STREAM = 0xFFFFFFFF
#: Stream reserved for the Hadamard sign flip.
HADAMARD_STREAM = 0xFFFFFFFE


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) words of the 64-bit product of the 32-bit constant ``m`` and words ``x``.

    ``x * m`` may reach 2^64, past int64; ``x * (m - 2^32)`` (for ``m >= 2^31``, as both Philox
    multipliers are) is exact, ``|q| < 2^63``, and ``x * m = q + x * 2^32``: the low word is
    ``q``'s (``&`` takes a negative int64 modulo 2^32) and the high word is ``floor(q / 2^32) +
    x`` (an arithmetic shift floors). Four tensor operations, where splitting ``x`` into 16-bit
    halves takes nine (the suite's CPU runs spent a tenth of their time here).
    """
    if m >= 1 << 31:
        q = x * (m - (1 << 32))
        hi = q >> 32
        hi += x
    else:
        q = x * m  # < 2^63
        hi = q >> 32
    q &= _MASK  # (in place: q is this call's own)
    return hi, q


def philox4x32(
    counters: torch.Tensor, key: int, stream: int, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on counters ``(c, c >> 32, stream, step)`` with a 64-bit ``key``.

    Args:
        counters: int64 tensor of non-negative counters (< 2^63).
        key: 64-bit key (the seed).
        stream, step: 32-bit words 2 and 3 of the counter.

    Returns:
        The four output words, each an int64 tensor of values in [0, 2^32).
    """
    c0 = counters & _MASK
    return philox_rounds(
        c0,
        (counters >> 32) & _MASK,
        torch.full_like(c0, stream & _MASK),
        torch.full_like(c0, step & _MASK),
        key & _MASK,
        (key >> 32) & _MASK,
    )


def philox_rounds(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ten Philox4x32 rounds on four int64 tensors of 32-bit words and a 2-word key (the
    xors in place on each round's own products: a third fewer temporaries, the CPU tests'
    hot loop)."""
    for _ in range(_ROUNDS):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        hi1 ^= c1
        hi1 ^= k0
        hi0 ^= c3
        hi0 ^= k1
        c0, c1, c2, c3 = hi1, lo1, hi0, lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def uniform(
    n: int, *, seed: int, step: int, stream: int, offset: int = 0, device=None
) -> torch.Tensor:
    """``n`` float32 variates in (0, 1) for element indices ``offset .. offset + n - 1``.

    Element ``e`` takes the 16-bit half ``e % 2`` (low half first) of word ``(e % 8) // 2`` of
    counter ``e // 8`` and maps it to the bin centre ``(h + 0.5) / 2^16``: one Philox call feeds
    eight elements, and stochastic rounding with it is unbiased to within 2^-17 of a step.
    """
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    first = offset // 8
    last = (offset + n - 1) // 8
    words = philox4x32(
        torch.arange(first, last + 1, dtype=torch.int64, device=device), seed, stream, step
    )
    w = torch.stack(words, dim=1)  # [counters, 4]
    halves = torch.stack((w & 0xFFFF, w >> 16), dim=2).view(-1)  # element order
    start = offset - 8 * first
    out = halves[start : start + n].to(torch.float32)  # (a slice: no index tensor, no gather)
    out += 0.5
    out *= 2.0**-16
    return out


def group_uniform(n: int, *, seed: int, step: int, device=None) -> torch.Tensor:
    """One float32 U[0, 1) per group ``0 .. n-1`` (24 bits; the shift-lattice dither).

    Word 0 of counter ``g`` on the reserved stream :data:`LATTICE_STREAM`: the same for every
    rank, so all ranks share the step's lattice.
    """
    words = philox4x32(
        torch.arange(n, dtype=torch.int64, device=device), seed, LATTICE_STREAM, step
    )
    return (words[0] >> 8).to(torch.float32) * (2.0**-24)


def random_signs(h: int, seed: int, device=None) -> torch.Tensor:
    """The +-1 float32 sign vector of a seeded Hadamard block (same on every rank)."""
    words = philox4x32(torch.arange(h, dtype=torch.int64, device=device), seed, HADAMARD_STREAM, 0)
    return torch.where((words[0] & 1) == 0, 1.0, -1.0).to(torch.float32)
