"""Fused Triton kernels for the quantizers; ``qsdp.quant.reference`` is their specification.

[Note: one tile, three kernels]
A program owns ``ROWS`` whole groups, i.e. ``BLOCK = ROWS * GROUP`` consecutive elements, so every
group statistic is a row reduction of a ``[ROWS, GROUP]`` tile and Hadamard blocks (which divide
``GROUP``) never straddle programs. The building blocks are ``@triton.jit`` helpers shared by the
three kernels:

    encode            load x (- ref) -> [rotate] -> quantize -> pack codes + scale bytes
    decode            for k chunks: unpack + dequantize, fp32 sum -> [inverse rotate]
                      -> (+ out) -> store
    decode_sum_encode for k chunks: unpack + dequantize, fp32 sum -> quantize with the out spec

Scales are read and written byte by byte (little endian), so a payload may sit at any byte
offset of a larger buffer (all-to-all chunks are not 4-byte aligned). Float operations follow the
reference in order and kind: IEEE division (``div_rn``), no FMA contraction (launch with
``enable_fp_fusion=False``), ``floor(v + 0.5)`` for nearest rounding, butterflies for Hadamard.
"""

from __future__ import annotations

import triton
import triton.language as tl

_ABSMAX = tl.constexpr(0)
_MINMAX = tl.constexpr(1)
_LATTICE = tl.constexpr(2)


# --- random numbers -----------------------------------------------------------------------------
@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 counter words with a uint32 key pair."""
    m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
    m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(m1, a2) ^ c1 ^ k0
        c2 = tl.umulhi(m0, a0) ^ c3 ^ k1
        c1 = m1 * a2
        c3 = m0 * a0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _to_uniform(w):
    return (w >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _counter_words(ctr, stream, step, key0, key1):
    """Philox words for int64 counters ``ctr`` with counter words (lo, hi, stream, step)."""
    c0 = (ctr & 0xFFFFFFFF).to(tl.uint32)
    c1 = (ctr >> 32).to(tl.uint32)
    c2 = tl.full(c0.shape, 0, tl.uint32) + stream.to(tl.uint32)
    c3 = tl.full(c0.shape, 0, tl.uint32) + step.to(tl.uint32)
    k0 = tl.full(c0.shape, 0, tl.uint32) + key0.to(tl.uint32)
    k1 = tl.full(c0.shape, 0, tl.uint32) + key1.to(tl.uint32)
    return _philox(c0, c1, c2, c3, k0, k1)


@triton.jit
def _element_noise(pid, key0, key1, stream, step, BLOCK: tl.constexpr):
    """U[0,1) for the BLOCK elements of this program: word e % 4 of counter e // 4."""
    ctr = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4).to(tl.int64)
    w0, w1, w2, w3 = _counter_words(ctr, stream, step, key0, key1)
    w = tl.join(tl.join(w0, w2), tl.join(w1, w3))
    return _to_uniform(tl.reshape(w, (BLOCK,)))


# --- Hadamard -----------------------------------------------------------------------------------
@triton.jit
def _fwht(x, BLOCK: tl.constexpr, H: tl.constexpr, LOG_H: tl.constexpr):
    """Unnormalized Walsh-Hadamard butterflies over each run of H elements of a [BLOCK] tile."""
    M: tl.constexpr = BLOCK // H
    y = x
    for i in tl.static_range(LOG_H):
        v = tl.reshape(y, (M, H // (2 << i), 2, 1 << i))
        v = tl.permute(v, (0, 1, 3, 2))
        a, b = tl.split(v)
        v = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        y = tl.reshape(v, (BLOCK,))
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
    BLOCK: tl.constexpr,
    H: tl.constexpr,
    LOG_H: tl.constexpr,
):
    """Forward (``H (d * x)``) or inverse (``d * (H y)``) rotation of whole blocks only."""
    y = x
    if HAS_SIGNS:
        d = tl.reshape(
            tl.broadcast_to(tl.load(signs_ptr + tl.arange(0, H))[None, :], (BLOCK // H, H)),
            (BLOCK,),
        )
    if HAS_SIGNS and not INVERSE:
        y = y * d
    y = _fwht(y, BLOCK, H, LOG_H) * inv_sqrt_h
    if HAS_SIGNS and INVERSE:
        y = y * d
    full = (offs - offs % H + H) <= numel
    return tl.where(full, y, x)


# --- scales as bytes ----------------------------------------------------------------------------
@triton.jit
def _store_field(
    ptr, gidx, gmask, value, FIELD: tl.constexpr, FIELDS: tl.constexpr, SCALE_BF16: tl.constexpr
):
    bits = value.to(tl.uint32, bitcast=True)
    if SCALE_BF16:
        addr = ptr + gidx * (2 * FIELDS) + 2 * FIELD
        tl.store(addr, ((bits >> 16) & 0xFF).to(tl.uint8), mask=gmask)
        tl.store(addr + 1, (bits >> 24).to(tl.uint8), mask=gmask)
    else:
        addr = ptr + gidx * (4 * FIELDS) + 4 * FIELD
        for j in tl.static_range(4):
            tl.store(addr + j, ((bits >> (8 * j)) & 0xFF).to(tl.uint8), mask=gmask)


@triton.jit
def _load_field(
    ptr, gidx, gmask, FIELD: tl.constexpr, FIELDS: tl.constexpr, SCALE_BF16: tl.constexpr
):
    if SCALE_BF16:
        addr = ptr + gidx * (2 * FIELDS) + 2 * FIELD
        bits = tl.load(addr, mask=gmask, other=0).to(tl.uint32) << 16
        bits = bits | (tl.load(addr + 1, mask=gmask, other=0).to(tl.uint32) << 24)
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
def _cast_out(x, DTYPE: tl.constexpr):
    """float32 -> DTYPE, round to nearest even (bf16 by hand: the interpreter truncates)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


# --- code packing -------------------------------------------------------------------------------
@triton.jit
def _pack(codes, BLOCK: tl.constexpr, BITS: tl.constexpr):
    if BITS == 8:
        out = codes
    elif BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (BLOCK // 2, 2)))
        out = lo | (hi << 4)
    else:
        a, b = tl.split(tl.reshape(codes, (BLOCK // 4, 2, 2)))
        p0, p1 = tl.split(a | (b << 2))
        out = p0 | (p1 << 4)
    return out.to(tl.uint8)


@triton.jit
def _unpack(raw, BLOCK: tl.constexpr, BITS: tl.constexpr):
    b = raw.to(tl.int32)
    if BITS == 8:
        codes = b
    elif BITS == 4:
        codes = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK,))
    else:
        pair = tl.join(b & 15, b >> 4)
        codes = tl.reshape(tl.join(pair & 3, pair >> 2), (BLOCK,))
    return codes


# --- quantize / dequantize one tile ---------------------------------------------------------------
@triton.jit
def _quantize_store(
    x,
    mask,
    pid,
    out_ptr,
    scale_region,
    n_code_bytes,
    n_groups,
    key0,
    key1,
    stream,
    step,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    SCHEME: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    """Quantize a [BLOCK] float32 tile (ROWS groups) and write its codes and scale bytes."""
    BLOCK: tl.constexpr = ROWS * GROUP
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    MAXC: tl.constexpr = (1 << BITS) - 1
    xr = tl.reshape(x, (ROWS, GROUP))
    mr = tl.reshape(mask, (ROWS, GROUP))
    nonfinite = ((xr != xr) | (tl.abs(xr) == float("inf"))) & mr
    bad = tl.max(nonfinite.to(tl.int32), axis=1) > 0
    xr = tl.where(bad[:, None], 0.0, xr)
    if STOCHASTIC:
        u = tl.reshape(_element_noise(pid, key0, key1, stream, step, BLOCK), (ROWS, GROUP))
    else:
        u = 0.5
    gidx = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    if SCHEME == _ABSMAX:
        amax = tl.max(tl.where(mr, tl.abs(xr), 0.0), axis=1)
        s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        if SCALE_BF16:
            s = _round_up_bf16(s)
        inv = tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
        q = tl.floor(xr * inv[:, None] + u)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        codes = q.to(tl.int32) + QMAX
        f0 = s
        f1 = s
    else:
        lo = tl.min(tl.where(mr, xr, float("inf")), axis=1)
        hi = tl.max(tl.where(mr, xr, -float("inf")), axis=1)
        if SCHEME == _MINMAX:
            unit = tl.math.div_rn(hi - lo, tl.full(lo.shape, MAXC, tl.float32))
            inv = tl.where(unit > 0, tl.math.div_rn(tl.full(lo.shape, 1.0, tl.float32), unit), 0.0)
            base = lo
        else:
            unit = tl.math.div_rn(hi - lo, tl.full(lo.shape, MAXC - 1, tl.float32))
            inv = tl.where(unit > 0, tl.math.div_rn(tl.full(lo.shape, 1.0, tl.float32), unit), 0.0)
            w0, w1, w2, w3 = _counter_words(
                gidx, tl.full((), 0xFFFFFFFF, tl.uint32), step, key0, key1
            )
            xi = _to_uniform(w0)
            k0 = tl.floor(lo * inv - xi)
            base = tl.where(unit > 0, (k0 + xi) * unit, lo)
        q = tl.floor((xr - base[:, None]) * inv[:, None] + u)
        q = tl.minimum(tl.maximum(q, 0.0), MAXC)
        codes = q.to(tl.int32)
        f0 = base
        f1 = unit
    codes = tl.where(mr & ~bad[:, None], codes, 0)
    f0 = tl.where(bad, float("nan"), f0)
    NB: tl.constexpr = BLOCK * BITS // 8
    boffs = pid * NB + tl.arange(0, NB).to(tl.int64)
    packed = _pack(tl.reshape(codes, (BLOCK,)), BLOCK, BITS)
    tl.store(out_ptr + scale_region + boffs, packed, mask=boffs < n_code_bytes)
    gmask = gidx < n_groups
    FIELDS: tl.constexpr = 1 if SCHEME == _ABSMAX else 2
    _store_field(out_ptr, gidx, gmask, f0, 0, FIELDS, SCALE_BF16)
    if FIELDS == 2:
        _store_field(out_ptr, gidx, gmask, f1, 1, FIELDS, SCALE_BF16)


@triton.jit
def _decode_sum(
    in_ptr,
    chunk_stride,
    pid,
    scale_region,
    n_code_bytes,
    n_groups,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    SCHEME: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    K: tl.constexpr,
):
    """Float32 sum over k stacked payloads of this program's [BLOCK] values (rotated domain)."""
    BLOCK: tl.constexpr = ROWS * GROUP
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    FIELDS: tl.constexpr = 1 if SCHEME == _ABSMAX else 2
    NB: tl.constexpr = BLOCK * BITS // 8
    boffs = pid * NB + tl.arange(0, NB).to(tl.int64)
    gidx = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    gmask = gidx < n_groups
    acc = tl.zeros((ROWS, GROUP), tl.float32)
    for k in tl.static_range(K):
        base_ptr = in_ptr + k * chunk_stride
        raw = tl.load(base_ptr + scale_region + boffs, mask=boffs < n_code_bytes, other=0)
        codes = tl.reshape(_unpack(raw, BLOCK, BITS), (ROWS, GROUP))
        f0 = _load_field(base_ptr, gidx, gmask, 0, FIELDS, SCALE_BF16)
        if SCHEME == _ABSMAX:
            vals = (codes - QMAX).to(tl.float32) * f0[:, None]
        else:
            f1 = _load_field(base_ptr, gidx, gmask, 1, FIELDS, SCALE_BF16)
            vals = f0[:, None] + codes.to(tl.float32) * f1[:, None]
        acc = acc + vals
    return tl.reshape(acc, (BLOCK,))


# --- kernels ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["numel", "key0", "key1", "stream", "step"])
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
    stream,
    step,
    inv_sqrt_h,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    SCHEME: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    HAS_REF: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    H: tl.constexpr,
    LOG_H: tl.constexpr,
):
    BLOCK: tl.constexpr = ROWS * GROUP
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_REF:
        x = x - tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x = _rotate(x, offs, numel, signs_ptr, inv_sqrt_h, False, HAS_SIGNS, BLOCK, H, LOG_H)
    _quantize_store(
        x,
        mask,
        pid,
        out_ptr,
        scale_region,
        n_code_bytes,
        n_groups,
        key0,
        key1,
        stream,
        step,
        BITS,
        GROUP,
        ROWS,
        SCHEME,
        STOCHASTIC,
        SCALE_BF16,
    )


@triton.jit(do_not_specialize=["numel"])
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
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    SCHEME: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    K: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    H: tl.constexpr,
    LOG_H: tl.constexpr,
):
    BLOCK: tl.constexpr = ROWS * GROUP
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < numel
    acc = _decode_sum(
        in_ptr,
        chunk_stride,
        pid,
        scale_region,
        n_code_bytes,
        n_groups,
        BITS,
        GROUP,
        ROWS,
        SCHEME,
        SCALE_BF16,
        K,
    )
    if ROTATE:
        acc = _rotate(acc, offs, numel, signs_ptr, inv_sqrt_h, True, HAS_SIGNS, BLOCK, H, LOG_H)
    if ACCUMULATE:
        acc = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptr + offs, _cast_out(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel", "key0", "key1", "stream", "step"])
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
    stream,
    step,
    IN_BITS: tl.constexpr,
    IN_SCHEME: tl.constexpr,
    IN_SCALE_BF16: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    SCHEME: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    K: tl.constexpr,
):
    BLOCK: tl.constexpr = ROWS * GROUP
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < numel
    acc = _decode_sum(
        in_ptr,
        chunk_stride,
        pid,
        in_scale_region,
        in_code_bytes,
        n_groups,
        IN_BITS,
        GROUP,
        ROWS,
        IN_SCHEME,
        IN_SCALE_BF16,
        K,
    )
    _quantize_store(
        acc,
        mask,
        pid,
        out_ptr,
        out_scale_region,
        out_code_bytes,
        n_groups,
        key0,
        key1,
        stream,
        step,
        BITS,
        GROUP,
        ROWS,
        SCHEME,
        STOCHASTIC,
        SCALE_BF16,
    )
