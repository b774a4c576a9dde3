"""The quantizers in plain torch: the specification every Triton kernel is tested against.

Every function works on any device. The arithmetic is float32 in a fixed order (see
``hadamard.py`` and the per-scheme formulas below), which the Triton kernels repeat op for op, so
the two backends agree bit for bit for nearest rounding and, given the same Philox noise, for
stochastic rounding.

Per group (``r`` is the rounding: ``floor(v + 0.5)`` or ``floor(v + u)``, then a clamp; ``F``
is ``STEP_FLOOR = 2^-126``, see [Note: step floor])::

    absmax         s = max|x| / qmax (bf16 scales: rounded up), then max(s, F) if max|x| > 0
                   code = r(x * (1/s)) + qmax             value = (code - qmax) * s
    minmax         unit = (max - min) / (2^b - 1), then max(unit, F) if max > min
                   code = r((x - min) * (1/unit))         value = min + code * unit
    shift-lattice  delta = (max - min) / (2^b - 2), then max(delta, F) if max > min;
                   xi ~ U[0,1) per group and step (rank-shared)
                   base = (floor(min/delta - xi) + xi) * delta
                   code = r((x - base) * (1/delta))       value = base + code * delta

A group with a NaN or Inf gets NaN as its first scale field, zero in its other field and zero
codes; the caller decides whether that raises (default) or propagates. So does a group that is
not representable (below).

[Note: representable range]
Decoding is monotone in the code, so a group's decoded values lie between two numbers computed
with the decode's own float32 operations: ``-qmax * s`` and ``qmax * s`` (absmax), ``base`` and
``top = base + (2^b - 1) * unit`` (minmax, shift-lattice; ``unit`` is ``delta``). A group is
*not representable* when ``unit`` or one of these bounds, times the headroom ``R``, is not
finite; encode flags it like a NaN group, so no payload ever decodes to NaN or Inf by overflow.
``R`` is 1 without Hadamard and ``2h`` with ``hadamard_block=h``: the inverse butterflies'
partial sums reach ``h`` times the largest rotated value before the ``1/sqrt(h)`` multiply, and
the factor 2 covers their rounding (``R`` is a power of two, so ``bound * R`` is exact). absmax
caps its step at the largest ``s`` of the scale dtype whose ``qmax * s`` is finite (only a
group holding values within a few ulps of the float32 maximum, or above the bfloat16 maximum
with bf16 scales, meets the cap; it then clips by less than half a step). What this guarantees::

    scheme                 hadamard_block=None     hadamard_block=h
    absmax                 every finite x          |x| <= 2^126 / h^2  (h=32: 8.3e34)
    minmax, shift-lattice  |x| <= 2^126 (8.5e37)   |x| <= 2^126 / h^2

Beyond a limit a group is refused only if it really overflows (``QuantSpec.value_limit`` gives
the limit). Why 2^126: then ``max - min <= 2^127``, and shift-lattice's grid ends at most
``(max - min) / (2^b - 2)`` beyond ``max``, so ``base`` and ``top`` stay within 2^127. With
Hadamard, rotated values are at most ``sqrt(h) |x|`` and the decoded bound at most twice the
rotated maximum, so ``R`` times it stays below 2^128. A sum of ``k`` payloads
(``decode_sum``) is a float32 sum: it overflows, like any, when the sum leaves float32's range.

[Note: step floor]
The step of a group that is not constant (absmax: ``max|x| > 0``; minmax, shift-lattice:
``max > min``) is at least ``STEP_FLOOR = 2^-126``, float32's smallest normal number (1.18e-38); a
constant group keeps its step 0 and decodes exactly. Without the floor, a step below 2^-126 (8-bit
minmax: a range below 3.0e-36) was subnormal and kept only a few bits, and below 2^-128 its
reciprocal overflowed to inf: codes came from ``+-inf`` and ``0 * inf = NaN`` (8-bit minmax decoded
-8.01e-38 as +3.41e-37), and shift-lattice's grid offset became NaN, so the group was refused. With
the floor, ``1/step <= 2^126`` is finite and the step is a normal float32. For every finite ``x``
within the representable range above, in the quantizer's (rotated) domain, with ``step`` the
unfloored ``max|x| / qmax`` (bf16 scales: rounded up), ``(max - min) / (2^b - 1)`` or
``(max - min) / (2^b - 2)``::

    nearest     |decode(x) - x| <= max(step, 2^-126) / 2      (absolute term 2^-127 = 5.9e-39)
    stochastic  |decode(x) - x| <  max(step, 2^-126)          (and unbiased: no code clips)

plus float32 rounding: a few units in the last place of the group's largest ``|x|``, which below
2^-126 is an absolute ``2^-149``. Signs: absmax never flips one (``x * (1/s)`` rounds to an integer
of its sign or to zero); minmax and shift-lattice may, but only within the bound (a group whose
values all lie within ``2^-127`` of its minimum decodes to the minimum, or to the grid point next to
it). Global-QSGD floors its step ``M / s`` the same way, with ``M' = max(M, s * 2^-126)`` on both
sides (``qsdp.quant.global_int``). The floor costs a compare and a select per group, nothing per
element; it is conditioned on the group's range, not on the divided step, so a GPU division that
flushed a subnormal step to zero would floor alike. Flushing tiny groups to zero was the
alternative; it would bias stochastic rounding, which the floor keeps unbiased.
"""

from __future__ import annotations

import functools
import math

import torch

from .hadamard import hadamard_forward, hadamard_inverse
from .philox import group_uniform, uniform
from .spec import STEP_FLOOR, QuantSpec, Rounding, Scheme

__all__ = [
    "decode_flat",
    "decode_sum_encode_flat",
    "decode_sum_flat",
    "encode_flat",
    "pack_codes",
    "unpack_codes",
]


# --- scales ---------------------------------------------------------------------------------
def _round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 >= s for s >= 0, returned as float32 (so codes never clip)."""
    bits = s.view(torch.int32)
    up = torch.where((bits & 0xFFFF) != 0, (bits + 0x10000) & -65536, bits)
    return up.view(torch.float32)


def _fields_to_bytes(fields: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if spec.scale_dtype == torch.bfloat16:
        # The high half of each float32, as the kernels store it: the fields are bf16 values
        # already (rounded up, capped) or the flag's NaN, which .to(bfloat16) does not pin down
        # (0xFFFF on CPU, 0x7FFF on CUDA; the high half is 0x7FC0).
        high = fields.contiguous().view(torch.int32) >> 16
        return high.to(torch.int16).view(torch.uint8).reshape(-1)
    return fields.to(spec.scale_dtype).contiguous().view(torch.uint8).reshape(-1)


def _bytes_to_fields(raw: torch.Tensor, groups: int, spec: QuantSpec) -> torch.Tensor:
    # .clone(): a chunk of a stacked payload need not be aligned for a float view.
    return raw.clone().view(spec.scale_dtype).to(torch.float32).reshape(groups, spec.scale_fields)


# --- packing --------------------------------------------------------------------------------
def _word(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte word of ``bits``-bit codes: (4, 1) for 2
    bits, (2, 1) for 4, (1, 1) for 8, (8, 3) for 3 and (4, 3) for 6."""
    per = math.lcm(bits, 8) // bits
    return per, per * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int codes in [0, 2^bits) into ``ceil(n * bits / 8)`` bytes: a little-endian bit
    stream, element i at bits ``[i * bits, (i + 1) * bits)`` (for 2, 4 and 8 bits: bit
    ``(i * bits) % 8`` of byte ``i * bits // 8``)."""
    per, nbytes = _word(bits)
    n = codes.numel()
    if nbytes == 1:  # 2, 4 and 8 bits: ``per`` whole codes a byte, shifted in byte arithmetic
        lanes = torch.zeros(-(-n // per) * per, dtype=torch.uint8, device=codes.device)
        lanes[:n] = codes.reshape(-1)  # codes < 2^bits fit a byte
        lanes = lanes.reshape(-1, per)
        out = lanes[:, 0].clone()
        for j in range(1, per):
            out |= lanes[:, j] << (bits * j)
        return out
    padded = torch.zeros(-(-n // per) * per, dtype=torch.int64, device=codes.device)
    padded[:n] = codes.reshape(-1)
    lanes = padded.reshape(-1, per)
    word = torch.zeros(lanes.shape[0], dtype=torch.int64, device=codes.device)
    for j in range(per):
        word |= lanes[:, j] << (bits * j)
    shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int64) * 8
    out = ((word.reshape(-1, 1) >> shifts) & 255).reshape(-1)
    return out[: -(-n * bits // 8)].to(torch.uint8)


def unpack_codes(raw: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 codes of the first ``numel`` elements."""
    per, nbytes = _word(bits)
    if nbytes == 1:  # 2, 4 and 8 bits: ``per`` whole codes a byte
        shifts = torch.arange(per, device=raw.device, dtype=torch.uint8) * bits
        lanes = (raw.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)
        return lanes.reshape(-1)[:numel].to(torch.int32)
    b = torch.zeros(-(-raw.numel() // nbytes) * nbytes, dtype=torch.int64, device=raw.device)
    b[: raw.numel()] = raw.reshape(-1)
    shifts = torch.arange(nbytes, device=raw.device, dtype=torch.int64) * 8
    word = (b.reshape(-1, nbytes) << shifts).sum(dim=1, keepdim=True)
    lanes = torch.arange(per, device=raw.device, dtype=torch.int64) * bits
    return ((word >> lanes) & ((1 << bits) - 1)).reshape(-1)[:numel].to(torch.int32)


# --- group quantization -----------------------------------------------------------------------
def _group_view(flat: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[groups, G] float32 view (zero padded) and its validity mask."""
    n, g = flat.numel(), spec.group_size
    ng = spec.num_groups(n)
    padded = torch.zeros(ng * g, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    valid = torch.zeros(ng * g, dtype=torch.bool, device=flat.device)
    valid[:n] = True
    return padded.reshape(ng, g), valid.reshape(ng, g)


def _div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 division on every device.

    Both operands become float32 tensors of one shape: CUDA torch turns ``tensor / scalar`` into
    a multiply by the reciprocal, which rounds differently from the kernels' ``div_rn``.
    """
    like = a if isinstance(a, torch.Tensor) else b
    a = a if isinstance(a, torch.Tensor) else torch.full_like(like, a)
    b = b if isinstance(b, torch.Tensor) else torch.full_like(like, b)
    return torch.div(a, b)


def _round(v: torch.Tensor, spec: QuantSpec, noise: torch.Tensor | None) -> torch.Tensor:
    if spec.rounding is Rounding.NEAREST:
        return torch.floor(v + 0.5)
    return torch.floor(v + noise)


def step_cap(spec: QuantSpec) -> float:
    """Largest absmax step ``s`` of ``spec.scale_dtype`` whose ``qmax * s`` is finite in float32
    (see [Note: representable range])."""
    return _step_cap(spec.qmax, spec.scale_dtype == torch.bfloat16)


@functools.lru_cache(maxsize=16)
def _step_cap(qmax: int, bf16: bool) -> float:
    fmax = torch.finfo(torch.float32).max
    bits = int(torch.tensor(fmax / qmax, dtype=torch.float32).view(torch.int32))
    if bf16:
        bits &= -65536
    ulp = 0x10000 if bf16 else 1
    while not torch.isfinite(torch.tensor([bits], dtype=torch.int32).view(torch.float32) * qmax):
        bits -= ulp
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32))


def headroom(spec: QuantSpec) -> float:
    """Factor ``R`` the decoded bounds must stay finite under: 1, or ``2h`` with Hadamard
    (see [Note: representable range])."""
    return 2.0 * spec.hadamard_block if spec.hadamard_block else 1.0


def _fits(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return torch.isfinite(v * headroom(spec))


def _quantize_groups(
    x: torch.Tensor,
    valid: torch.Tensor,
    spec: QuantSpec,
    *,
    seed: int,
    step: int,
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [groups, G] (int32, 0 outside ``valid``) and scale fields [groups, F] (float32)."""
    ng, g = x.shape
    bad = (~torch.isfinite(x) & valid).any(dim=1, keepdim=True)
    x = torch.where(bad, 0.0, x)
    noise = None
    if spec.rounding is Rounding.STOCHASTIC:
        noise = uniform(ng * g, seed=seed, step=step, stream=stream, device=x.device)
        noise = noise.reshape(ng, g)
    inf = torch.tensor(float("inf"), device=x.device)
    if spec.scheme is Scheme.ABSMAX:
        amax = torch.where(valid, x.abs(), 0.0).amax(dim=1, keepdim=True)
        s = _div(amax, spec.qmax)
        if spec.scale_dtype == torch.bfloat16:
            s = _round_up_bf16(s)
        s = torch.where(amax > 0, torch.clamp(s, min=STEP_FLOOR), s)  # [Note: step floor]
        s = torch.clamp(s, max=step_cap(spec))
        inv = torch.where(s > 0, _div(1.0, s), 0.0)
        q = _round(x * inv, spec, noise).clamp(-spec.qmax, spec.qmax)
        codes = q.to(torch.int32) + spec.qmax
        fields = s
        fits = _fits(s * float(spec.qmax), spec)
    else:
        lo = torch.where(valid, x, inf).amin(dim=1, keepdim=True)
        hi = torch.where(valid, x, -inf).amax(dim=1, keepdim=True)
        unit = _div(hi - lo, spec.max_code if spec.scheme is Scheme.MINMAX else spec.max_code - 1)
        unit = torch.where(hi > lo, torch.clamp(unit, min=STEP_FLOOR), unit)  # [Note: step floor]
        if spec.scheme is Scheme.MINMAX:
            base = lo
        else:
            xi = group_uniform(ng, seed=seed, step=step, device=x.device).reshape(ng, 1)
            inv_u = torch.where(unit > 0, _div(1.0, unit), 0.0)
            k0 = torch.floor(lo * inv_u - xi)
            base = torch.where(unit > 0, (k0 + xi) * unit, lo)
        inv = torch.where(unit > 0, _div(1.0, unit), 0.0)
        q = _round((x - base) * inv, spec, noise).clamp(0, spec.max_code)
        codes = q.to(torch.int32)
        fields = torch.cat((base, unit), dim=1)
        # the decode's largest value, op for op: base + code * unit
        fits = _fits(base, spec) & _fits(base + unit * float(spec.max_code), spec)
    # [Note: representable range]: a group that would decode past float32 is flagged like NaN
    bad = bad | ~fits
    codes = torch.where(valid & ~bad, codes, 0)
    fields = torch.where(bad, 0.0, fields)
    fields[:, :1] = torch.where(bad, float("nan"), fields[:, :1])
    return codes, fields


def _dequantize_groups(codes: torch.Tensor, fields: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if spec.scheme is Scheme.ABSMAX:
        return (codes - spec.qmax).to(torch.float32) * fields[:, :1]
    return fields[:, :1] + codes.to(torch.float32) * fields[:, 1:2]


# --- flat encode / decode -----------------------------------------------------------------------
def encode_flat(
    flat: torch.Tensor,
    spec: QuantSpec,
    *,
    seed: int = 0,
    step: int = 0,
    stream: int = 0,
    rotate: bool = True,
) -> torch.Tensor:
    """Payload (uint8, ``spec.payload_bytes(n)``) of a float32 1-D tensor.

    ``rotate=False`` skips the forward Hadamard (the input is already in the rotated domain).
    """
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    if spec.hadamard_block and rotate:
        flat = hadamard_forward(flat, spec)
    x, valid = _group_view(flat, spec)
    codes, fields = _quantize_groups(x, valid, spec, seed=seed, step=step, stream=stream)
    packed = pack_codes(codes.reshape(-1)[:n], spec.bits)
    return torch.cat((_fields_to_bytes(fields, spec), packed))


def _decode_rotated(payload: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    ng = spec.num_groups(numel)
    sb = ng * spec.scale_bytes
    fields = _bytes_to_fields(payload[:sb], ng, spec)
    codes = torch.zeros(ng * spec.group_size, dtype=torch.int32, device=payload.device)
    codes[:numel] = unpack_codes(payload[sb:], numel, spec.bits)
    vals = _dequantize_groups(codes.reshape(ng, spec.group_size), fields, spec)
    return vals.reshape(-1)[:numel]


def decode_flat(
    payload: torch.Tensor, numel: int, spec: QuantSpec, *, rotate: bool = True
) -> torch.Tensor:
    """Float32 values of one payload (inverse Hadamard applied unless ``rotate=False``)."""
    return decode_sum_flat(payload.reshape(1, -1), numel, spec, rotate=rotate)


def decode_sum_flat(
    payloads: torch.Tensor, numel: int, spec: QuantSpec, *, rotate: bool = True
) -> torch.Tensor:
    """Float32 sum of ``k`` payloads stacked as ``[k, payload_bytes]``, summed in row order."""
    acc = torch.zeros(numel, dtype=torch.float32, device=payloads.device)
    if numel == 0:
        return acc
    for row in payloads:
        acc = acc + _decode_rotated(row, numel, spec)
    if spec.hadamard_block and rotate:
        acc = hadamard_inverse(acc, spec)
    return acc


def decode_sum_encode_flat(
    payloads: torch.Tensor,
    numel: int,
    in_spec: QuantSpec,
    out_spec: QuantSpec,
    *,
    seed: int = 0,
    step: int = 0,
    stream: int = 0,
) -> torch.Tensor:
    """Decode ``k`` payloads, sum in float32 and re-encode with ``out_spec``, all in the rotated
    domain (the middle hop of the two-level reduce-scatter)."""
    acc = decode_sum_flat(payloads, numel, in_spec, rotate=False)
    return encode_flat(acc, out_spec, seed=seed, step=step, stream=stream, rotate=False)
