"""Fused Triton kernels for the quantizers; ``qsdp.quant.reference`` is their specification.

[Note: one tile, three kernels]
A program owns ``ROWS`` whole groups as a ``[ROWS, GPB, HB]`` tile: row = group, and each group
is ``GPB`` runs of ``HB`` elements (``HB`` is the Hadamard block when the kernel rotates, else
the whole group and ``GPB == 1``). Group statistics are reductions over the last two axes;
butterflies act along the last axis only, which keeps them in registers (reshaping a
``[ROWS, GROUP]`` tile into blocks costs a layout conversion per stage). Helpers shared by the
three kernels:

    encode            load x (- ref) -> [rotate] -> quantize -> pack codes + scale bytes
    decode            for k chunks: unpack + dequantize, fp32 sum -> [inverse rotate]
                      -> (+ out) -> store
    decode_sum_encode for k chunks: unpack + dequantize, fp32 sum -> quantize with the out spec

Scales are read and written as whole words when the launcher sees them aligned (``ALIGNED``),
else byte by byte (little endian), so a payload may sit at any byte offset of a larger buffer
(all-to-all chunks are not 4-byte aligned). Float operations follow the
reference in order and kind: IEEE division (``div_rn``), no FMA contraction (launch with
``enable_fp_fusion=False``), ``floor(v + 0.5)`` for nearest rounding, butterflies for Hadamard.
Offsets are int32 unless the launcher sets ``BIG`` (tensors of 2^31 elements or bytes and more).
Each op is two launches: the main grid over whole tiles, compiled without masks, and one ``TAIL``
program for the last partial tile (its masks and tail-block checks cost the main grid nothing).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..spec import STEP_FLOOR

_ABSMAX = tl.constexpr(0)
_MINMAX = tl.constexpr(1)
_LATTICE = tl.constexpr(2)
#: The reference's [Note: step floor]: 2^-126, the smallest step of a group that is not constant.
_STEP_FLOOR = tl.constexpr(STEP_FLOOR)
#: Whether ``triton.jit`` made these kernels interpreted functions (it reads the variable when
#: this module is imported, as this line does).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


# --- random numbers -----------------------------------------------------------------------------
@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 counter words with a uint32 key pair. Its products and key
    bumps wrap modulo 2^32 by design: ``sanitize_overflow=False`` says so (as Triton's own
    Philox does), and spares the interpreter an overflow check per operation whose verdict it
    drops without ``TRITON_DEBUG`` (an interpreted 4-bit encode of 4,096 elements: 66 -> 30-41 ms
    on the development machine)."""
    m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
    m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(m1, a2) ^ c1 ^ k0
        c2 = tl.umulhi(m0, a0) ^ c3 ^ k1
        c1 = tl.mul(m1, a2, sanitize_overflow=False)
        c3 = tl.mul(m0, a0, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _counter_words(ctr, rng_stream, step, key0, key1):
    """Philox words for integer counters ``ctr`` with counter words (lo, hi, rng_stream, step)."""
    c64 = ctr.to(tl.int64)
    c0 = (c64 & 0xFFFFFFFF).to(tl.uint32)
    c1 = (c64 >> 32).to(tl.uint32)
    zero = tl.zeros(c0.shape, tl.uint32)
    return _philox(
        c0=c0,
        c1=c1,
        c2=zero + rng_stream.to(tl.uint32),
        c3=zero + step.to(tl.uint32),
        k0=zero + key0.to(tl.uint32),
        k1=zero + key1.to(tl.uint32),
    )


@triton.jit
def _element_noise(
    gidx, key0, key1, rng_stream, step, ROWS: tl.constexpr, GPB: tl.constexpr, HB: tl.constexpr
):
    """U(0,1) for the tile: element e is half e % 2 of word (e % 8) // 2 of counter e // 8."""
    GROUP: tl.constexpr = GPB * HB
    ctr = (
        gidx[:, None, None] * (GROUP // 8)
        + (tl.arange(0, GPB) * (HB // 8))[None, :, None]
        + tl.arange(0, HB // 8)[None, None, :]
    )
    w0, w1, w2, w3 = _counter_words(ctr, rng_stream=rng_stream, step=step, key0=key0, key1=key1)
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (ROWS, GPB, HB // 8, 4))
    halves = tl.reshape(tl.join(w & 0xFFFF, w >> 16), (ROWS, GPB, HB))
    return (halves.to(tl.float32) + 0.5) * 1.52587890625e-05


@triton.jit
def _group_uniform(gidx, key0, key1, step):
    """One U[0,1) per group (the shift-lattice dither): word 0 of counter g, rng_stream 2^32-1."""
    w0, w1, w2, w3 = _counter_words(
        gidx, rng_stream=tl.full((), 0xFFFFFFFF, tl.uint32), step=step, key0=key0, key1=key1
    )
    return (w0 >> 8).to(tl.float32) * 5.9604644775390625e-08


# --- Hadamard -----------------------------------------------------------------------------------
@triton.jit
def _fwht(y, ROWS: tl.constexpr, GPB: tl.constexpr, H: tl.constexpr, LOG_H: tl.constexpr):
    """Unnormalized Walsh-Hadamard butterflies along the last axis of a [ROWS, GPB, H] tile."""
    for i in tl.static_range(LOG_H):
        v = tl.reshape(y, (ROWS * GPB, H // (2 << i), 2, 1 << i))
        v = tl.permute(v, (0, 1, 3, 2))
        a, b = tl.split(v)
        v = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        y = tl.reshape(v, (ROWS, GPB, H))
    return y


@triton.jit
def _rotate(
    x,
    offs,
    numel,
    signs_ptr,
    inv_sqrt_h,
    INVERSE: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    H: tl.constexpr,
    LOG_H: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Forward (``H (d * x)``) or inverse (``d * (H y)``) rotation of the tile's whole blocks
    (``offs`` are its element offsets; a block past ``numel`` stays as it is)."""
    y = x
    if HAS_SIGNS:
        d = tl.load(signs_ptr + tl.arange(0, H))[None, None, :]
    if HAS_SIGNS and not INVERSE:
        y = y * d
    y = _fwht(y, ROWS=ROWS, GPB=GPB, H=H, LOG_H=LOG_H) * inv_sqrt_h
    if HAS_SIGNS and INVERSE:
        y = y * d
    if TAIL or not INVERSE:
        # Forward, the select also pays for itself on whole tiles: it brings the butterflies'
        # output back to the load's layout before the group reductions (H200, 256 MiB bf16,
        # 8-bit: 0.22 ms with it, 0.31 ms without).
        return tl.where((offs - offs % H + H) <= numel, y, x)
    return y


# --- scales as bytes ----------------------------------------------------------------------------
@triton.jit
def _store_field(
    ptr,
    gidx,
    gmask,
    value,
    FIELD: tl.constexpr,
    FIELDS: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    bits = value.to(tl.uint32, bitcast=True)
    if SCALE_BF16:
        if ALIGNED:
            wide = ptr.to(tl.pointer_type(tl.uint16))
            tl.store(wide + gidx * FIELDS + FIELD, (bits >> 16).to(tl.uint16), mask=gmask)
        else:
            addr = ptr + gidx * (2 * FIELDS) + 2 * FIELD
            tl.store(addr, ((bits >> 16) & 0xFF).to(tl.uint8), mask=gmask)
            tl.store(addr + 1, (bits >> 24).to(tl.uint8), mask=gmask)
    elif ALIGNED:
        wide = ptr.to(tl.pointer_type(tl.uint32))
        tl.store(wide + gidx * FIELDS + FIELD, bits, mask=gmask)
    else:
        addr = ptr + gidx * (4 * FIELDS) + 4 * FIELD
        for j in tl.static_range(4):
            tl.store(addr + j, ((bits >> (8 * j)) & 0xFF).to(tl.uint8), mask=gmask)


@triton.jit
def _load_field(
    ptr,
    gidx,
    gmask,
    FIELD: tl.constexpr,
    FIELDS: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if SCALE_BF16:
        if ALIGNED:
            wide = ptr.to(tl.pointer_type(tl.uint16))
            bits = tl.load(wide + gidx * FIELDS + FIELD, mask=gmask, other=0).to(tl.uint32) << 16
        else:
            addr = ptr + gidx * (2 * FIELDS) + 2 * FIELD
            bits = tl.load(addr, mask=gmask, other=0).to(tl.uint32) << 16
            bits = bits | (tl.load(addr + 1, mask=gmask, other=0).to(tl.uint32) << 24)
    elif ALIGNED:
        wide = ptr.to(tl.pointer_type(tl.uint32))
        bits = tl.load(wide + gidx * FIELDS + FIELD, mask=gmask, other=0)
    else:
        addr = ptr + gidx * (4 * FIELDS) + 4 * FIELD
        bits = tl.load(addr, mask=gmask, other=0).to(tl.uint32)
        for j in tl.static_range(1, 4):
            bits = bits | (tl.load(addr + j, mask=gmask, other=0).to(tl.uint32) << (8 * j))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_up_bf16(s):
    bits = s.to(tl.int32, bitcast=True)
    up = tl.where((bits & 0xFFFF) != 0, (bits + 0x10000) & -65536, bits)
    return up.to(tl.float32, bitcast=True)


@triton.jit
def _cast_out(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> DTYPE rounding to nearest even (bf16 by hand where the interpreter truncates)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, tl.full(x.shape, 0x7FC0, tl.uint32), rne)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


# --- tiles and code packing -----------------------------------------------------------------------
@triton.jit
def _tile(pid, ROWS: tl.constexpr, GPB: tl.constexpr, HB: tl.constexpr, BIG: tl.constexpr):
    """Group indices [ROWS] and element offsets [ROWS, GPB, HB] of this program."""
    rows = tl.arange(0, ROWS)
    if BIG:
        gidx = pid.to(tl.int64) * ROWS + rows
    else:
        gidx = pid * ROWS + rows
    inner = (tl.arange(0, GPB) * HB)[None, :, None] + tl.arange(0, HB)[None, None, :]
    return gidx, gidx[:, None, None] * (GPB * HB) + inner


@triton.jit
def _byte_offsets(gidx, GPB: tl.constexpr, HB: tl.constexpr, BITS: tl.constexpr):
    """Offsets of the tile's code bytes (2, 4 and 8 bits: [ROWS, GPB, HB * BITS // 8]) or of
    the first byte of its 3-byte words (3 and 6 bits: [ROWS, GPB, HB * BITS // 24])."""
    NB: tl.constexpr = HB * BITS // 8
    if BITS == 3 or BITS == 6:
        inner = (tl.arange(0, GPB) * NB)[None, :, None] + (tl.arange(0, NB // 3) * 3)[None, None, :]
    else:
        inner = (tl.arange(0, GPB) * NB)[None, :, None] + tl.arange(0, NB)[None, None, :]
    return gidx[:, None, None] * (GPB * NB) + inner


@triton.jit
def _pack(codes, ROWS: tl.constexpr, GPB: tl.constexpr, HB: tl.constexpr, BITS: tl.constexpr):
    """[ROWS, GPB, HB] codes -> their bytes (2, 4, 8 bits) or 24-bit words (3, 6 bits: 8 or 4
    codes a word), low bits first.

    A byte (word) is the weighted sum of its codes (weights 1, 2^b, 2^2b, ...; the codes are
    below 2^b so the sum is the bitwise OR).
    """
    if BITS == 8:
        out = codes
    else:
        PER: tl.constexpr = 24 // BITS if BITS == 3 or BITS == 6 else 8 // BITS
        weights = (1 << (tl.arange(0, PER) * BITS))[None, None, None, :]
        out = tl.sum(tl.reshape(codes, (ROWS, GPB, HB // PER, PER)) * weights, axis=3)
    return out


@triton.jit
def _store_bytes(ptr, offs, value, n_code_bytes, TAIL: tl.constexpr):
    """``value``'s low byte at ``ptr + offs``; with TAIL, none at or past ``n_code_bytes``."""
    if TAIL:
        tl.store(ptr + offs, (value & 255).to(tl.uint8), mask=offs < n_code_bytes)
    else:
        tl.store(ptr + offs, (value & 255).to(tl.uint8))


@triton.jit
def _load_bytes(ptr, offs, n_code_bytes, TAIL: tl.constexpr):
    """The bytes at ``ptr + offs`` as int32; with TAIL, those at or past ``n_code_bytes`` 0."""
    if TAIL:
        return tl.load(ptr + offs, mask=offs < n_code_bytes, other=0).to(tl.int32)
    return tl.load(ptr + offs).to(tl.int32)


@triton.jit
def _word_bytes(boffs, n_code_bytes, TAIL: tl.constexpr):
    """Offsets and mask of the 3-byte words at ``boffs`` (``_byte_offsets``) as one
    ``[words, ROWS, GPB, 4]`` tensor of bytes, the fourth masked off (with TAIL, also those at or
    past ``n_code_bytes``).

    Words first and bytes at consecutive offsets: the compiler orders axes of equal contiguity
    by position, so a warp's lanes go along the bytes of a word, then along the words of one
    group. Three accesses of one byte per word (offsets 3 apart) read as no contiguity, and it
    laid the lanes along the groups, each lane a row of its own (PTX for sm_90: one 32-byte
    sector per lane and byte; 6-bit encodes ran at 0.06 of copy bandwidth on H200)."""
    j = tl.arange(0, 4)[None, None, None, :]
    offs = tl.permute(boffs, (2, 0, 1))[:, :, :, None] + j
    keep = j < 3
    if TAIL:
        keep = keep & (offs < n_code_bytes)
    return offs, keep


@triton.jit
def _store_codes(
    ptr,
    boffs,
    codes,
    n_code_bytes,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    BITS: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Pack and store the tile's codes at ``ptr + boffs`` (``_byte_offsets``); with TAIL, no
    byte at or past ``n_code_bytes``. 3-byte words go as their bytes (``_word_bytes``)."""
    packed = _pack(codes, ROWS=ROWS, GPB=GPB, HB=HB, BITS=BITS)
    if BITS == 3 or BITS == 6:
        # join(a, b)[..., k, i] is (a, b)[i][..., k]: bytes 0 and 2, then 1 and (none), joined
        # as (even, odd) give the word's bytes 0, 1, 2, - in order
        even = tl.join(packed & 255, (packed >> 16) & 255)
        odd = tl.join((packed >> 8) & 255, packed & 0)
        quad = tl.reshape(tl.join(even, odd), (ROWS, GPB, HB * BITS // 24, 4))
        offs, keep = _word_bytes(boffs, n_code_bytes, TAIL=TAIL)
        tl.store(ptr + offs, tl.permute(quad, (2, 0, 1, 3)).to(tl.uint8), mask=keep)
    else:
        _store_bytes(ptr, boffs, packed, n_code_bytes, TAIL=TAIL)


@triton.jit
def _load_codes(
    ptr,
    boffs,
    n_code_bytes,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    BITS: tl.constexpr,
    TAIL: tl.constexpr,
):
    """The tile's [ROWS, GPB, HB] int32 codes from ``ptr + boffs`` (``_byte_offsets``); with
    TAIL, bytes at or past ``n_code_bytes`` read as 0.

    Codes come out of a byte (word) by halving it repeatedly: ``join(b & low, b >> half)`` puts
    the low half at index 0 of a new last axis, so after the splits the flattened index of a
    code is its position in the byte (word)."""
    if BITS == 3 or BITS == 6:
        # three byte loads, not the stores' [words, ..., 4] tensor (_word_bytes): loaded that
        # way the decodes ran at 0.42-0.46 of copy bandwidth on H200 against 0.55-0.79 so
        # (benchmarks/results/quant_widths_2026-11-27/ against quant_widths_2026-11-26/)
        word = _load_bytes(ptr, boffs, n_code_bytes, TAIL=TAIL)
        word = word | (_load_bytes(ptr, boffs + 1, n_code_bytes, TAIL=TAIL) << 8)
        word = word | (_load_bytes(ptr, boffs + 2, n_code_bytes, TAIL=TAIL) << 16)
        half = tl.join(word & 4095, word >> 12)
        sixes = tl.join(half & 63, half >> 6)
        if BITS == 6:
            codes = tl.reshape(sixes, (ROWS, GPB, HB))
        else:
            codes = tl.reshape(tl.join(sixes & 7, sixes >> 3), (ROWS, GPB, HB))
    else:
        b = _load_bytes(ptr, boffs, n_code_bytes, TAIL=TAIL)
        if BITS == 8:
            codes = b
        elif BITS == 4:
            codes = tl.reshape(tl.join(b & 15, b >> 4), (ROWS, GPB, HB))
        else:
            pair = tl.join(b & 15, b >> 4)
            codes = tl.reshape(tl.join(pair & 3, pair >> 2), (ROWS, GPB, HB))
    return codes


@triton.jit
def _load(ptr, mask, TAIL: tl.constexpr):
    """Float32 load; only the tail program masks (the main grid holds whole tiles)."""
    if TAIL:
        v = tl.load(ptr, mask=mask, other=0.0)
    else:
        v = tl.load(ptr)
    if _INTERPRETED and v.dtype == tl.bfloat16:
        # the interpreter's bf16 -> float32 cast mangles subnormals (triton 3.6: it normalizes
        # their mantissa, then stores it as a subnormal's); the bits shifted up are exact
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _row_max(v):
    return tl.max(tl.max(v, axis=2), axis=1)


@triton.jit
def _row_min(v):
    return tl.min(tl.min(v, axis=2), axis=1)


# --- quantize / dequantize one tile ---------------------------------------------------------------
@triton.jit
def _quantize_store(
    x,
    mask,
    gidx,
    out_ptr,
    scale_region,
    n_code_bytes,
    n_groups,
    key0,
    key1,
    rng_stream,
    step,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    SCHEME: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    STEP_CAP: tl.constexpr,
    HEADROOM: tl.constexpr,
    ALIGNED: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Quantize a float32 tile and write its codes and scale bytes (``mask`` only with TAIL).

    A group whose decoded bounds, times ``HEADROOM``, overflow is flagged like a NaN group, and
    absmax caps its step at ``STEP_CAP`` (the reference's [Note: representable range]).
    """
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    MAXC: tl.constexpr = (1 << BITS) - 1
    INF: tl.constexpr = float("inf")
    # Non-finite inputs are flagged through the row max (+inf beats any finite value); their
    # lanes' codes are garbage and zeroed below with the rest of a bad group.
    ax = tl.abs(x)
    nonfinite = (ax != ax) | (ax == INF)
    if STOCHASTIC:
        u = _element_noise(
            gidx, key0=key0, key1=key1, rng_stream=rng_stream, step=step, ROWS=ROWS, GPB=GPB, HB=HB
        )
    else:
        u = 0.5
    one = tl.full((ROWS,), 1.0, tl.float32)
    if SCHEME == _ABSMAX:
        # the non-finite flag rides on the max: +inf wins over any finite |x|
        flagged = tl.where(nonfinite, INF, ax)
        if TAIL:
            flagged = tl.where(mask, flagged, 0.0)
        amax = _row_max(flagged)
        bad = amax == INF
        amax = tl.where(bad, 0.0, amax)
        s = tl.math.div_rn(amax, one * QMAX)
        if SCALE_BF16:
            s = _round_up_bf16(s)
        # [Note: step floor]; on amax, not s: a GPU division that flushed a subnormal s to zero
        # would floor alike
        s = tl.where(amax > 0, tl.maximum(s, _STEP_FLOOR), s)
        s = tl.minimum(s, STEP_CAP)
        inv = tl.where(s > 0, tl.math.div_rn(one, s), 0.0)
        q = tl.floor(x * inv[:, None, None] + u)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        codes = q.to(tl.int32) + QMAX
        f0 = s
        f1 = s
        if HEADROOM != 1.0:  # without Hadamard the cap alone keeps qmax * s finite
            bad = bad | ~(tl.abs(s * QMAX * HEADROOM) < INF)
    else:
        low = x
        high = tl.where(nonfinite, INF, x)
        if TAIL:
            low = tl.where(mask, low, INF)
            high = tl.where(mask, high, -INF)
        lo = _row_min(low)
        hi = _row_max(high)
        bad = hi == INF
        hi = tl.where(bad, lo, hi)
        LEVELS: tl.constexpr = MAXC if SCHEME == _MINMAX else MAXC - 1
        unit = tl.math.div_rn(hi - lo, one * LEVELS)
        unit = tl.where(hi > lo, tl.maximum(unit, _STEP_FLOOR), unit)  # [Note: step floor]
        inv = tl.where(unit > 0, tl.math.div_rn(one, unit), 0.0)
        if SCHEME == _MINMAX:
            base = lo
        else:
            xi = _group_uniform(gidx, key0=key0, key1=key1, step=step)
            k0 = tl.floor(lo * inv - xi)
            base = tl.where(unit > 0, (k0 + xi) * unit, lo)
        q = tl.floor((x - base[:, None, None]) * inv[:, None, None] + u)
        q = tl.minimum(tl.maximum(q, 0.0), MAXC)
        codes = q.to(tl.int32)
        f0 = base
        f1 = unit
        # the decode's largest value, op for op: base + code * unit
        top = base + unit * MAXC
        bad = bad | ~((tl.abs(base * HEADROOM) < INF) & (tl.abs(top * HEADROOM) < INF))
    if TAIL:
        codes = tl.where(mask & ~bad[:, None, None], codes, 0)
    else:
        codes = tl.where(bad[:, None, None], 0, codes)
    f0 = tl.where(bad, float("nan"), f0)
    f1 = tl.where(bad, 0.0, f1)
    boffs = _byte_offsets(gidx, GPB=GPB, HB=HB, BITS=BITS)
    _store_codes(
        out_ptr + scale_region,
        boffs,
        codes,
        n_code_bytes,
        ROWS=ROWS,
        GPB=GPB,
        HB=HB,
        BITS=BITS,
        TAIL=TAIL,
    )
    gmask = gidx < n_groups
    FIELDS: tl.constexpr = 1 if SCHEME == _ABSMAX else 2
    _store_field(
        out_ptr,
        gidx,
        gmask,
        value=f0,
        FIELD=0,
        FIELDS=FIELDS,
        SCALE_BF16=SCALE_BF16,
        ALIGNED=ALIGNED,
    )
    if FIELDS == 2:
        _store_field(
            out_ptr,
            gidx,
            gmask,
            value=f1,
            FIELD=1,
            FIELDS=FIELDS,
            SCALE_BF16=SCALE_BF16,
            ALIGNED=ALIGNED,
        )


@triton.jit
def _decode_sum(
    in_ptr,
    chunk_stride,
    gidx,
    scale_region,
    n_code_bytes,
    n_groups,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    SCHEME: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    K: tl.constexpr,
    ALIGNED: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Float32 sum over K stacked payloads of the tile's values (rotated domain)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    FIELDS: tl.constexpr = 1 if SCHEME == _ABSMAX else 2
    boffs = _byte_offsets(gidx, GPB=GPB, HB=HB, BITS=BITS)
    gmask = gidx < n_groups
    acc = tl.zeros((ROWS, GPB, HB), tl.float32)
    for k in tl.static_range(K):
        base_ptr = in_ptr + k * chunk_stride
        codes = _load_codes(
            base_ptr + scale_region,
            boffs,
            n_code_bytes,
            ROWS=ROWS,
            GPB=GPB,
            HB=HB,
            BITS=BITS,
            TAIL=TAIL,
        )
        f0 = _load_field(
            base_ptr, gidx, gmask, FIELD=0, FIELDS=FIELDS, SCALE_BF16=SCALE_BF16, ALIGNED=ALIGNED
        )
        if SCHEME == _ABSMAX:
            vals = (codes - QMAX).to(tl.float32) * f0[:, None, None]
        else:
            f1 = _load_field(
                base_ptr,
                gidx,
                gmask,
                FIELD=1,
                FIELDS=FIELDS,
                SCALE_BF16=SCALE_BF16,
                ALIGNED=ALIGNED,
            )
            vals = f0[:, None, None] + codes.to(tl.float32) * f1[:, None, None]
        acc = acc + vals
    return acc


# --- runs of a flat buffer ----------------------------------------------------------------------
@triton.jit
def _run_of(x, ends_ptr, n_runs, SEARCH: tl.constexpr):
    """The run each offset of ``x`` lies in: how many of the ``n_runs`` cumulative run ends at
    ``ends_ptr`` are ``<= x`` (a binary search of ``SEARCH`` halvings, ``SEARCH`` at least the
    bit length of ``n_runs``); ``n_runs`` for an offset past the last run."""
    lo = x * 0
    hi = lo + n_runs
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        active = lo < hi
        end = tl.load(ends_ptr + mid, mask=active, other=0)
        right = active & (end <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    return lo


# --- kernels ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["key0", "key1", "rng_stream", "step", "skip_row"])
def encode_kernel(
    x_ptr,
    ref_ptr,
    out_ptr,
    signs_ptr,
    numel,
    scale_region,
    n_code_bytes,
    n_groups,
    key0,
    key1,
    rng_stream,
    step,
    inv_sqrt_h,
    pid_base,
    x_row_stride,
    out_row_stride,
    skip_row,
    streams_ptr,
    step_ptr,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    SCHEME: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    STEP_CAP: tl.constexpr,
    HEADROOM: tl.constexpr,
    HAS_REF: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    LOG_H: tl.constexpr,
    BIG: tl.constexpr,
    ALIGNED: tl.constexpr,
    MULTI: tl.constexpr,
    STEP_PTR: tl.constexpr,
    TAIL: tl.constexpr,
):
    """One payload of ``numel`` elements per grid row. ``MULTI``: grid row ``s`` encodes input
    row ``s + (s >= skip_row)`` (rows ``x_row_stride`` apart: every row but ``skip_row``) into
    the payload at ``out_ptr + s * out_row_stride`` with noise stream ``streams_ptr[s]``; else
    the one row at ``x_ptr`` with ``rng_stream``. ``STEP_PTR``: the noise's step is read from
    device memory (``step_ptr``, one int64), not the launch argument ``step``: a launch
    captured in a CUDA graph draws each replay's noise ([Note: codec segments replayed] in
    ``qsdp.comm._graphs``)."""
    if STEP_PTR:
        step = tl.load(step_ptr)
    gidx, offs = _tile(tl.program_id(0) + pid_base, ROWS=ROWS, GPB=GPB, HB=HB, BIG=BIG)
    if MULTI:
        slot = tl.program_id(1)
        if BIG:
            slot = slot.to(tl.int64)
        src_row = slot + (slot >= skip_row).to(slot.dtype)
        x_ptr = x_ptr + src_row * x_row_stride
        out_ptr = out_ptr + slot * out_row_stride
        rng_stream = tl.load(streams_ptr + slot)
    mask = offs < numel
    x = _load(x_ptr + offs, mask, TAIL=TAIL)
    if HAS_REF:
        x = x - _load(ref_ptr + offs, mask, TAIL=TAIL)
    if ROTATE:
        x = _rotate(
            x,
            offs=offs,
            numel=numel,
            signs_ptr=signs_ptr,
            inv_sqrt_h=inv_sqrt_h,
            INVERSE=False,
            HAS_SIGNS=HAS_SIGNS,
            ROWS=ROWS,
            GPB=GPB,
            H=HB,
            LOG_H=LOG_H,
            TAIL=TAIL,
        )
    _quantize_store(
        x,
        mask=mask,
        gidx=gidx,
        out_ptr=out_ptr,
        scale_region=scale_region,
        n_code_bytes=n_code_bytes,
        n_groups=n_groups,
        key0=key0,
        key1=key1,
        rng_stream=rng_stream,
        step=step,
        BITS=BITS,
        ROWS=ROWS,
        GPB=GPB,
        HB=HB,
        SCHEME=SCHEME,
        STOCHASTIC=STOCHASTIC,
        SCALE_BF16=SCALE_BF16,
        STEP_CAP=STEP_CAP,
        HEADROOM=HEADROOM,
        ALIGNED=ALIGNED,
        TAIL=TAIL,
    )


@triton.jit
def decode_kernel(
    in_ptr,
    chunk_stride,
    out_ptr,
    signs_ptr,
    numel,
    scale_region,
    n_code_bytes,
    n_groups,
    inv_sqrt_h,
    row_stride,
    out_row_stride,
    pid_base,
    base_ptr,
    divisor,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    SCHEME: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    K: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    LOG_H: tl.constexpr,
    BIG: tl.constexpr,
    INTERPRET: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_BASE: tl.constexpr,
    DIVIDE: tl.constexpr,
    TAIL: tl.constexpr,
):
    """The float32 sum of K payloads (``ACCUMULATE``: onto ``out``; ``HAS_BASE``: onto the
    values at ``base_ptr``), divided by ``divisor`` (``DIVIDE``, IEEE), cast to ``out``'s
    dtype. (Stores stay contiguous: a scatter to a policy split's runs inside the kernel, by a
    search of the runs per tile, made the reduce-scatter's decode 4-7x slower on 2x H200.)"""
    # grid axis 1: independent rows (decode_rows), each its own payload and output
    row = tl.program_id(1).to(tl.int64)
    in_ptr = in_ptr + row * row_stride
    out_ptr = out_ptr + row * out_row_stride
    gidx, offs = _tile(tl.program_id(0) + pid_base, ROWS=ROWS, GPB=GPB, HB=HB, BIG=BIG)
    mask = offs < numel
    acc = _decode_sum(
        in_ptr,
        chunk_stride=chunk_stride,
        gidx=gidx,
        scale_region=scale_region,
        n_code_bytes=n_code_bytes,
        n_groups=n_groups,
        BITS=BITS,
        ROWS=ROWS,
        GPB=GPB,
        HB=HB,
        SCHEME=SCHEME,
        SCALE_BF16=SCALE_BF16,
        K=K,
        ALIGNED=ALIGNED,
        TAIL=TAIL,
    )
    if ROTATE:
        acc = _rotate(
            acc,
            offs=offs,
            numel=numel,
            signs_ptr=signs_ptr,
            inv_sqrt_h=inv_sqrt_h,
            INVERSE=True,
            HAS_SIGNS=HAS_SIGNS,
            ROWS=ROWS,
            GPB=GPB,
            H=HB,
            LOG_H=LOG_H,
            TAIL=TAIL,
        )
    if HAS_BASE:
        acc = _load(base_ptr + offs, mask, TAIL=TAIL) + acc
    elif ACCUMULATE:
        acc = _load(out_ptr + offs, mask, TAIL=TAIL) + acc
    if DIVIDE:
        acc = tl.math.div_rn(acc, divisor)
    acc = _cast_out(acc, DTYPE=out_ptr.dtype.element_ty, INTERPRET=INTERPRET)
    if TAIL:
        tl.store(out_ptr + offs, acc, mask=mask)
    else:
        tl.store(out_ptr + offs, acc)


@triton.jit(do_not_specialize=["key0", "key1", "rng_stream", "step"])
def decode_sum_encode_kernel(
    in_ptr,
    chunk_stride,
    out_ptr,
    numel,
    in_scale_region,
    in_code_bytes,
    out_scale_region,
    out_code_bytes,
    n_groups,
    key0,
    key1,
    rng_stream,
    step,
    pid_base,
    step_ptr,
    IN_BITS: tl.constexpr,
    IN_SCHEME: tl.constexpr,
    IN_SCALE_BF16: tl.constexpr,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    GPB: tl.constexpr,
    HB: tl.constexpr,
    SCHEME: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    STEP_CAP: tl.constexpr,
    HEADROOM: tl.constexpr,
    K: tl.constexpr,
    BIG: tl.constexpr,
    IN_ALIGNED: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP_PTR: tl.constexpr,
    TAIL: tl.constexpr,
):
    """The float32 sum of K payloads re-encoded, as ``encode_kernel`` quantizes. ``STEP_PTR``:
    the noise's step read from device memory (``step_ptr``), as ``encode_kernel``'s."""
    if STEP_PTR:
        step = tl.load(step_ptr)
    gidx, offs = _tile(tl.program_id(0) + pid_base, ROWS=ROWS, GPB=GPB, HB=HB, BIG=BIG)
    mask = offs < numel
    acc = _decode_sum(
        in_ptr,
        chunk_stride=chunk_stride,
        gidx=gidx,
        scale_region=in_scale_region,
        n_code_bytes=in_code_bytes,
        n_groups=n_groups,
        BITS=IN_BITS,
        ROWS=ROWS,
        GPB=GPB,
        HB=HB,
        SCHEME=IN_SCHEME,
        SCALE_BF16=IN_SCALE_BF16,
        K=K,
        ALIGNED=IN_ALIGNED,
        TAIL=TAIL,
    )
    _quantize_store(
        acc,
        mask=mask,
        gidx=gidx,
        out_ptr=out_ptr,
        scale_region=out_scale_region,
        n_code_bytes=out_code_bytes,
        n_groups=n_groups,
        key0=key0,
        key1=key1,
        rng_stream=rng_stream,
        step=step,
        BITS=BITS,
        ROWS=ROWS,
        GPB=GPB,
        HB=HB,
        SCHEME=SCHEME,
        STOCHASTIC=STOCHASTIC,
        SCALE_BF16=SCALE_BF16,
        STEP_CAP=STEP_CAP,
        HEADROOM=HEADROOM,
        ALIGNED=ALIGNED,
        TAIL=TAIL,
    )


@triton.jit(do_not_specialize=["key0", "key1", "rng_stream", "step"])
def global_int_encode_kernel(
    x_ptr,
    scale_ptr,
    out_ptr,
    numel,
    n_groups,
    levels,
    key0,
    key1,
    rng_stream,
    step,
    pid_base,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BIG: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Global-QSGD codes ``clamp(r(x * (levels / M')), -levels, levels)`` in the carrier dtype,
    ``M' = max(M, levels * 2^-126)`` (the reference's [Note: step floor])."""
    gidx, offs = _tile(tl.program_id(0) + pid_base, ROWS=ROWS, GPB=1, HB=GROUP, BIG=BIG)
    mask = offs < numel
    x = _load(x_ptr + offs, mask, TAIL=TAIL)
    m = tl.load(scale_ptr + gidx, mask=gidx < n_groups, other=0.0)
    lv = tl.full((ROWS,), 1.0, tl.float32) * levels
    floor = lv * _STEP_FLOOR
    m = tl.where(m < floor, floor, m)  # a NaN M stays NaN
    inv = tl.where(m > 0, tl.math.div_rn(lv, m), 0.0)
    if STOCHASTIC:
        u = _element_noise(
            gidx, key0=key0, key1=key1, rng_stream=rng_stream, step=step, ROWS=ROWS, GPB=1, HB=GROUP
        )
    else:
        u = 0.5
    q = tl.floor(x * inv[:, None, None] + u)
    q = tl.minimum(tl.maximum(q, -lv[:, None, None]), lv[:, None, None])
    q = q.to(out_ptr.dtype.element_ty)
    if TAIL:
        tl.store(out_ptr + offs, q, mask=mask)
    else:
        tl.store(out_ptr + offs, q)


@triton.jit
def run_flags_kernel(
    x_ptr,
    ends_ptr,
    flags_ptr,
    numel,
    row_stride,
    n_runs,
    limit,
    BLOCK: tl.constexpr,
    SEARCH: tl.constexpr,
    BIG: tl.constexpr,
):
    """``flags[p] = 1`` where run ``p`` of a row holds a value that is not ``|x| <= limit``
    (NaN always; +-Inf with any finite ``limit``). Program ``(i, row)`` reads ``BLOCK`` columns
    of one row; only a tile that holds such a value finds its runs (a binary search of the
    runs' ends, ``SEARCH`` halvings) and sets their flags by an atomic max, so the flags must
    start at zero. ``qsdp.quant.flags._run_flags_reference`` is the specification."""
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1)
    if BIG:
        col = col.to(tl.int64)
        row = row.to(tl.int64)
    mask = col < numel
    x = _load(x_ptr + row * row_stride + col, mask, TAIL=True)
    bad = (tl.abs(x) <= limit) == 0
    bad = bad & mask
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        run = _run_of(col, ends_ptr=ends_ptr, n_runs=n_runs, SEARCH=SEARCH)
        tl.atomic_max(flags_ptr + run, bad.to(tl.int32), mask=bad)


@triton.jit(do_not_specialize=["row_stride"])
def row_sum_kernel(
    rows_ptr,
    base_ptr,
    out_ptr,
    ends_ptr,
    starts_ptr,
    numel,
    row_stride,
    n_runs,
    divisor,
    K: tl.constexpr,
    DIVIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """``out`` at the runs' places gets ``(base + rows[0] + ... + rows[K-1]) / divisor``,
    summed in float32 in that order (``DIVIDE``: IEEE division), cast to ``out``'s dtype:
    element ``i`` (of run ``p``, found by a binary search of the runs' cumulative ``ends``)
    goes to ``out[starts[p] + i - (ends[p - 1] or 0)]``. ``qsdp.quant.rowsum`` is the
    specification."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    stride = row_stride.to(tl.int64)  # (K rows apart may pass 2^31 elements)
    acc = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        acc = acc + tl.load(rows_ptr + j * stride + offs, mask=mask, other=0.0).to(tl.float32)
    if DIVIDE:
        acc = tl.math.div_rn(acc, divisor)
    run = _run_of(offs, ends_ptr=ends_ptr, n_runs=n_runs, SEARCH=SEARCH)
    run = tl.where(mask, run, 0)
    first = tl.load(ends_ptr + run - 1, mask=mask & (run > 0), other=0)
    dest = tl.load(starts_ptr + run, mask=mask, other=0) + (offs - first)
    acc = _cast_out(acc, DTYPE=out_ptr.dtype.element_ty, INTERPRET=INTERPRET)
    tl.store(out_ptr + dest, acc, mask=mask)


@triton.jit
def zero_flagged_kernel(x_ptr, flag_ptr, numel, BLOCK: tl.constexpr, BIG: tl.constexpr):
    """``x[:numel] = 0`` (all-zero bits: +0.0 in any float format) where the word at
    ``flag_ptr`` is set; ``x`` is never read, and where the flag is clear a program reads that
    one word and writes nothing. ``qsdp.quant.flags._zero_flagged_reference`` (``masked_fill_``,
    which reads and writes every element either way) is the specification."""
    if tl.load(flag_ptr) != 0:
        pid = tl.program_id(0)
        if BIG:
            pid = pid.to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.zeros((BLOCK,), x_ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def zero_flagged_each_kernel(
    x_ptr, flags_ptr, rel_ptr, numel_ptr, param_ptr, first_ptr, k, BLOCK: tl.constexpr
):
    """:func:`zero_flagged_kernel` over ``k`` tensors in one launch: tensor ``i`` (this
    program's, ``param_ptr``; its first program ``first_ptr[i]``, its length ``numel_ptr[i]``)
    lies ``rel_ptr[i]`` elements from ``x_ptr`` and is zeroed where ``flags[rel_ptr[k + i]]``
    is set. A program whose flag is clear reads three words and writes nothing."""
    pid = tl.program_id(0)
    i = tl.load(param_ptr + pid)
    if tl.load(flags_ptr + tl.load(rel_ptr + k + i)) != 0:
        # (one 64-bit base a program, 32-bit offsets from it: few registers, whatever the size)
        start = (pid - tl.load(first_ptr + i)).to(tl.int64) * BLOCK
        base = x_ptr + tl.load(rel_ptr + i) + start
        offs = tl.arange(0, BLOCK)
        left = tl.load(numel_ptr + i) - start
        tl.store(base + offs, tl.zeros((BLOCK,), x_ptr.dtype.element_ty), mask=offs < left)
