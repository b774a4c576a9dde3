"""The quantizer specification: what a payload holds and how many bytes it takes.

[Note: payload layout]
One encoded tensor is one contiguous ``uint8`` buffer::

    | scales: groups x fields x scale_dtype | codes: ceil(numel * bits / 8) bytes |

``fields`` is 1 for ``absmax`` (the step ``s``) and 2 for ``minmax`` (``lo``, ``unit``) and
``shift-lattice`` (``base``, ``delta``), stored group-major (``g0.f0 g0.f1 g1.f0 ...``) in
little-endian byte order. Codes are unsigned, packed low bits first as one little-endian bit
stream: element ``i`` of the tensor at bits ``[i * bits, (i + 1) * bits)``, so two 4-bit codes
or four 2-bit codes a byte (element ``i`` at bit ``(i * bits) % 8`` of byte ``i * bits // 8``),
and eight 3-bit or four 6-bit codes in every 3 bytes. A group (16 elements or more, a power of
two) always fills whole bytes. Groups are ``group_size`` consecutive elements of the flattened
tensor; the last group may be short. Nothing else travels: the wire size is exactly
``groups * fields * scale_bytes + ceil(numel * bits / 8)``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["BITS", "STEP_FLOOR", "NonFinite", "QuantSpec", "Rounding", "Scheme"]

BITS = (2, 3, 4, 6, 8)
"""The code widths the payload format packs."""

STEP_FLOOR = 2.0**-126
"""Smallest quantization step of a group that is not constant: float32's smallest normal number
(1.18e-38). Every error bound is ``max(step, STEP_FLOOR)``-based (``qsdp.quant.reference``,
[Note: step floor])."""


class Scheme(str, enum.Enum):
    """How a group's codes map to values."""

    ABSMAX = "absmax"
    """Symmetric: ``q in [-(2^(b-1)-1), 2^(b-1)-1]``, value ``q * s``, ``s = max|x| / qmax``."""
    MINMAX = "minmax"
    """Asymmetric (CGX, QSDP gradients): value ``lo + q * unit``, ``q in [0, 2^b - 1]``."""
    SHIFT_LATTICE = "shift-lattice"
    """QSDP weights: nearest point of the grid ``delta * (k + xi)``, ``xi ~ U[0, 1)`` per step."""


class Rounding(str, enum.Enum):
    """How a scaled value becomes an integer code."""

    NEAREST = "nearest"
    """``floor(v + 0.5)``: deterministic, error at most half a step."""
    STOCHASTIC = "stochastic"
    """``floor(v + u)``, ``u ~ U[0, 1)`` from the counter-based generator: unbiased."""


class NonFinite(str, enum.Enum):
    """qsdp's one policy for NaN or Inf (or a group too large to represent,
    :meth:`QuantSpec.value_limit`): in an encode, a collective, or a training reduction
    (``qsdp.CompressionConfig.nonfinite``)."""

    RAISE = "raise"
    """Raise ``ValueError`` naming the count (the default: never send garbage silently); a
    collective raises on every rank together."""
    ZERO = "zero"
    """Training reductions only: zero the affected reduction's result for the step, counted."""
    PROPAGATE = "propagate"
    """Encode the group holding them as all-NaN, so the receiver sees NaN and can skip the step."""


_HADAMARD_BLOCKS = (16, 32, 64, 128, 256)
_SCALE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class QuantSpec:
    """A quantizer: bit width, grouping, level scheme and rounding, shared by sender and receiver.

    Example: ``QuantSpec(bits=4, group_size=128, scheme="absmax", rounding="stochastic",
    hadamard_block=32)`` is SDP4Bit's inter-node gradient quantizer.
    """

    bits: int
    """Bits per code: 2, 3, 4, 6 or 8 (3 and 6: the adaptive widths' in-between sizes)."""
    group_size: int
    """Elements sharing one scale: a power of two from 16 to 8192."""
    scheme: Scheme | str
    """``absmax``, ``minmax`` or ``shift-lattice``."""
    rounding: Rounding | str
    """``nearest`` or ``stochastic``."""
    hadamard_block: int | None = None
    """Rotate blocks of this many elements (power of two, 16..256) by the orthonormal Hadamard
    matrix before quantizing; a tail shorter than one block is left as it is."""
    scale_dtype: torch.dtype = torch.float32
    """Dtype of the per-group scales on the wire: float32, or bfloat16 (absmax only)."""
    hadamard_seed: int | None = None
    """With ``hadamard_block``: seed of a random +-1 sign flip applied before the rotation (the
    same on every rank); None for the plain Hadamard transform."""
    nonfinite: NonFinite | str = NonFinite.RAISE
    """What encode does with NaN/Inf input or a group too large to represent: ``raise`` or
    ``propagate``."""

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or self.bits not in BITS:
            raise ValueError(f"QuantSpec bits={self.bits!r} must be one of {BITS}")
        g = self.group_size
        if not isinstance(g, int) or g < 16 or g > 8192 or g & (g - 1):
            raise ValueError(
                f"QuantSpec group_size={g!r} must be a power of two from 16 to 8192; try 128"
            )
        object.__setattr__(self, "scheme", _as_enum(Scheme, self.scheme, "scheme"))
        object.__setattr__(self, "rounding", _as_enum(Rounding, self.rounding, "rounding"))
        object.__setattr__(self, "nonfinite", _as_enum(NonFinite, self.nonfinite, "nonfinite"))
        if self.nonfinite is NonFinite.ZERO:
            raise ValueError(
                "QuantSpec(nonfinite='zero'): an encode cannot zero a gradient; use 'raise' or "
                "'propagate' here, and CompressionConfig(nonfinite='zero') for training"
            )
        h = self.hadamard_block
        if h is not None:
            if not isinstance(h, int) or h not in _HADAMARD_BLOCKS:
                raise ValueError(
                    f"QuantSpec hadamard_block={h!r} must be None or one of {_HADAMARD_BLOCKS}; "
                    "try 32"
                )
            if h > g:
                raise ValueError(
                    f"QuantSpec hadamard_block={h} must not exceed group_size={g}: a group must "
                    f"hold whole blocks; use group_size={h} or more"
                )
        if self.hadamard_seed is not None:
            if h is None:
                raise ValueError(
                    "QuantSpec hadamard_seed is set but hadamard_block is None; set "
                    "hadamard_block=32 or drop the seed"
                )
            if not isinstance(self.hadamard_seed, int) or not 0 <= self.hadamard_seed < 2**64:
                raise ValueError(
                    f"QuantSpec hadamard_seed={self.hadamard_seed!r} must be an int in [0, 2**64)"
                )
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"QuantSpec scale_dtype={self.scale_dtype} must be torch.float32 or torch.bfloat16"
            )
        if self.scale_dtype == torch.bfloat16 and self.scheme is not Scheme.ABSMAX:
            raise ValueError(
                f"QuantSpec scale_dtype=torch.bfloat16 needs scheme='absmax' (got "
                f"{self.scheme.value!r}): a bf16 offset would move the grid; use torch.float32"
            )

    # --- derived layout -------------------------------------------------------------------
    @property
    def qmax(self) -> int:
        """Largest code magnitude of ``absmax`` (``2^(b-1) - 1``)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def max_code(self) -> int:
        """Largest unsigned code (``2^b - 1``)."""
        return (1 << self.bits) - 1

    @property
    def scale_fields(self) -> int:
        """Scale values stored per group: 1 for absmax, 2 (offset, step) otherwise."""
        return 1 if self.scheme is Scheme.ABSMAX else 2

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale metadata per group."""
        return self.scale_fields * self.scale_dtype.itemsize

    def num_groups(self, numel: int) -> int:
        """Groups for a tensor of ``numel`` elements (the last one may be short)."""
        return -(-numel // self.group_size)

    def code_bytes(self, numel: int) -> int:
        """Bytes of packed codes for ``numel`` elements."""
        return -(-numel * self.bits // 8)

    def payload_bytes(self, numel: int) -> int:
        """Exact wire size of one encoded tensor of ``numel`` elements."""
        return _payload_bytes(self, numel)

    def propagating(self) -> QuantSpec:
        """This spec with ``nonfinite="propagate"``: an encode that never raises (NaN/Inf
        groups travel as NaN). The one way qsdp encodes without raising: a collective decides
        ``"raise"`` once for every rank before its first exchange ([Note: NaN/Inf in a
        collective] in ``qsdp.comm._common``); plans and weight gathers leave NaN/Inf to the
        integration (``CompressionConfig.nonfinite``)."""
        if self.nonfinite is NonFinite.PROPAGATE:
            return self
        return dataclasses.replace(self, nonfinite=NonFinite.PROPAGATE)

    def step_bound(self) -> str:
        """Human-readable size of one quantization step, for error messages and docs (the floor
        is ``STEP_FLOOR``: [Note: step floor] in ``qsdp.quant.reference``)."""
        step = {
            Scheme.ABSMAX: f"max|x| / {self.qmax}",
            Scheme.MINMAX: f"(max - min) / {self.max_code}",
            Scheme.SHIFT_LATTICE: f"(max - min) / {self.max_code - 1}",
        }[self.scheme]
        return f"max({step}, 2^-126)"

    def value_limit(self) -> float:
        """Largest ``|x|`` every group is guaranteed to encode and decode finite (``inf`` for
        absmax without Hadamard: every finite value).

        ``2^126`` for minmax and shift-lattice, ``2^126 / h^2`` with ``hadamard_block=h``;
        beyond it a group is refused only when its decoded range would overflow float32
        (``qsdp.quant.reference``, [Note: representable range]).
        """
        if self.hadamard_block:
            return 2.0 ** (126 - 2 * (self.hadamard_block.bit_length() - 1))
        return math.inf if self.scheme is Scheme.ABSMAX else 2.0**126

    def __str__(self) -> str:
        had = f", hadamard={self.hadamard_block}" if self.hadamard_block else ""
        return f"{self.scheme.value}{self.bits}/g{self.group_size}/{self.rounding.value}{had}"


@functools.lru_cache(maxsize=4096)
def _payload_bytes(spec: QuantSpec, numel: int) -> int:
    """:meth:`QuantSpec.payload_bytes`, worked out once per (spec, size): collectives ask on
    every call."""
    return spec.num_groups(numel) * spec.scale_bytes + spec.code_bytes(numel)


def _as_enum(cls: type[enum.Enum], value: object, name: str):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"QuantSpec {name}={value!r} must be one of {choices}") from None


def inv_sqrt(h: int) -> float:
    """The float32 constant ``1/sqrt(h)`` both backends multiply by after the butterflies."""
    return float(torch.tensor(1.0 / math.sqrt(h), dtype=torch.float32))
