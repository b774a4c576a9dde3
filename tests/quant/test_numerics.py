"""Reference quantizer numerics: error bounds, unbiasedness, Hadamard, wire bytes."""

import math

import pytest
import torch

from qsdp.quant import (
    QuantSpec,
    decode,
    decode_add,
    decode_sum,
    decode_sum_encode,
    encode,
    encode_diff,
)
from qsdp.quant.hadamard import fwht, hadamard_forward, hadamard_inverse
from qsdp.quant.reference import pack_codes, unpack_codes

from .helpers import ODD_SIZES, group_steps, heavy_tailed

SCHEMES = ["absmax", "minmax", "shift-lattice"]
REF = {"backend": "reference"}


def _fp32_decode(enc):
    return decode_sum([enc], enc.numel, enc.spec, **REF)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", ODD_SIZES)
def test_nearest_error_at_most_half_a_step(bits, scheme, dtype, numel):
    spec = QuantSpec(bits, 64, scheme, "nearest")
    x = heavy_tailed(numel, seed=numel, dtype=dtype)
    enc = encode(x, spec, seed=1, step=2, **REF)
    xf = x.float()
    err = (_fp32_decode(enc) - xf).abs()
    step = group_steps(xf, spec)
    slack = 1e-5 * step + 1e-6 * xf.abs()
    assert bool((err <= 0.5 * step + slack).all()), float((err - 0.5 * step).max())
    # The error is real: a coarse grid does not reproduce the input.
    if bits < 8 and numel > 37:
        assert float(err.max()) > 0.05 * float(step.max())


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_stochastic_error_below_one_step(bits, scheme):
    spec = QuantSpec(bits, 128, scheme, "stochastic")
    x = heavy_tailed(4096 + 13, seed=3)
    for seed in range(5):
        err = (_fp32_decode(encode(x, spec, seed=seed, **REF)) - x).abs()
        step = group_steps(x, spec)
        assert bool((err < step * (1 + 1e-5) + 1e-6 * x.abs()).all())


@pytest.mark.parametrize(
    ("scheme", "rounding"),
    [
        ("absmax", "stochastic"),
        ("minmax", "stochastic"),
        ("shift-lattice", "stochastic"),
        ("shift-lattice", "nearest"),  # the random shift of the grid alone makes it unbiased
    ],
)
def test_unbiased_over_seeds(scheme, rounding):
    spec = QuantSpec(2, 32, scheme, rounding)
    x = heavy_tailed(333, seed=11)
    seeds = 1500
    total = torch.zeros(333, dtype=torch.float64)
    for s in range(seeds):
        # shift-lattice draws its dither from (seed, step): vary the step as training would
        total += _fp32_decode(encode(x, spec, seed=s, step=s, stream=7, **REF)).double()
    mean = total / seeds
    step = group_steps(x, spec).double()
    # per-seed variance <= step^2 / 4, so the mean's std <= step / (2 sqrt(seeds))
    z = (mean - x.double()).abs() / (step / (2 * math.sqrt(seeds)))
    assert float(z.max()) < 5.0, float(z.max())


def test_the_unbiasedness_test_can_fail():
    # Nearest rounding on a fixed grid is biased: the same statistic catches it.
    spec = QuantSpec(2, 32, "absmax", "nearest")
    x = heavy_tailed(333, seed=11)
    mean = _fp32_decode(encode(x, spec, **REF)).double()
    step = group_steps(x, spec).double()
    z = (mean - x.double()).abs() / (step / (2 * math.sqrt(1500)))
    assert float(z.max()) > 5.0


def test_ranks_draw_independent_noise():
    spec = QuantSpec(2, 32, "absmax", "stochastic")
    x = heavy_tailed(4000, seed=5)
    e1 = _fp32_decode(encode(x, spec, seed=1, stream=0, **REF)) - x
    e2 = _fp32_decode(encode(x, spec, seed=1, stream=1, **REF)) - x
    assert abs(float(torch.corrcoef(torch.stack((e1, e2)))[0, 1])) < 0.1
    e3 = _fp32_decode(encode(x, spec, seed=1, stream=0, **REF)) - x
    assert torch.equal(e1, e3)


def test_shift_lattice_dither_is_shared_by_streams():
    # The lattice is a property of the step, not of the rank: nearest codes ignore the stream.
    spec = QuantSpec(4, 64, "shift-lattice", "nearest")
    x = heavy_tailed(1000, seed=2)
    a = encode(x, spec, seed=3, step=9, stream=0, **REF).payload
    assert torch.equal(a, encode(x, spec, seed=3, step=9, stream=5, **REF).payload)
    assert not torch.equal(a, encode(x, spec, seed=3, step=10, stream=0, **REF).payload)


@pytest.mark.parametrize("h", [16, 32, 256])
def test_hadamard_is_orthonormal_and_self_inverse(h):
    spec = QuantSpec(4, 256, "absmax", "nearest", hadamard_block=h, hadamard_seed=4)
    x = torch.randn(5 * h + 7)
    y = hadamard_forward(x, spec)
    n = 5 * h
    torch.testing.assert_close(y[:n].norm(), x[:n].norm(), rtol=1e-6, atol=0)
    assert torch.equal(y[n:], x[n:])  # the short tail is not rotated
    torch.testing.assert_close(hadamard_inverse(y, spec), x, rtol=0, atol=1e-5)
    # matches the dense matrix definition H/sqrt(h) applied to the sign-flipped blocks
    hm = torch.ones(1, 1)
    while hm.shape[0] < h:
        hm = torch.cat((torch.cat((hm, hm), 1), torch.cat((hm, -hm), 1)), 0)
    rows = x[:n].reshape(-1, h).double()
    from qsdp.quant.philox import random_signs

    dense = (rows * random_signs(h, 4).double()) @ hm.double().T / math.sqrt(h)
    torch.testing.assert_close(y[:n].reshape(-1, h).double(), dense, rtol=0, atol=1e-5)
    assert torch.equal(fwht(torch.eye(h)), hm)


def test_hadamard_lowers_4bit_error_on_heavy_tails():
    x = heavy_tailed(64 * 1024, seed=8)
    plain = QuantSpec(4, 128, "absmax", "nearest")
    rotated = QuantSpec(4, 128, "absmax", "nearest", hadamard_block=32)
    mse_plain = float(((_fp32_decode(encode(x, plain, **REF)) - x) ** 2).mean())
    mse_rot = float(((_fp32_decode(encode(x, rotated, **REF)) - x) ** 2).mean())
    assert mse_rot < 0.5 * mse_plain, (mse_rot, mse_plain)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("numel", [0, *ODD_SIZES])
def test_wire_bytes_are_the_payload(bits, numel):
    spec = QuantSpec(bits, 128, "minmax", "nearest")
    enc = encode(torch.randn(numel), spec, **REF)
    expect = -(-numel * bits // 8) + -(-numel // 128) * 2 * 4
    assert enc.wire_bytes == enc.payload.numel() == expect
    assert enc.payload.dtype == torch.uint8 and enc.payload.is_contiguous()
    if numel >= 1000:  # vs bf16: 16 bits + 64 bits of scales per 128 values
        assert 2 * numel / enc.wire_bytes == pytest.approx(16 / (bits + 0.5), rel=0.01)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (1001,), dtype=torch.int32)
    packed = pack_codes(codes, bits)
    assert packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(unpack_codes(packed, 1001, bits), codes)
    if bits == 4:  # element 0 in the low nibble
        assert int(packed[0]) == int(codes[0]) | (int(codes[1]) << 4)
    # one little-endian bit stream: element i at bits [i * bits, (i + 1) * bits)
    stream = int.from_bytes(bytes(packed.tolist()), "little")
    assert all((stream >> (i * bits)) & ((1 << bits) - 1) == int(c) for i, c in enumerate(codes))


def test_bf16_scales_never_clip():
    spec = QuantSpec(4, 32, "absmax", "nearest", scale_dtype=torch.bfloat16)
    x = heavy_tailed(3000, seed=4)
    err = (_fp32_decode(encode(x, spec, **REF)) - x).abs()
    step = group_steps(x, spec)
    # rounding the scale up to bf16 widens the step by at most 2^-8
    assert bool((err <= 0.5 * step * (1 + 2**-7) + 1e-6).all())


def test_shape_dtype_and_noncontiguous_input():
    spec = QuantSpec(8, 64, "absmax", "nearest")
    x = torch.randn(33, 70, dtype=torch.bfloat16).t()
    assert not x.is_contiguous()
    enc = encode(x, spec, **REF)
    assert torch.equal(enc.payload, encode(x.contiguous(), spec, **REF).payload)
    y = decode(enc, **REF)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y, _fp32_decode(enc).reshape(x.shape).to(torch.bfloat16))


def test_empty_tensor():
    spec = QuantSpec(4, 64, "absmax", "stochastic")
    enc = encode(torch.empty(0, 3), spec, **REF)
    assert enc.wire_bytes == 0
    assert decode(enc, **REF).shape == (0, 3)


def test_encode_diff_and_decode_add_feed_back():
    spec = QuantSpec(4, 128, "absmax", "stochastic")
    base = torch.randn(1000).to(torch.bfloat16)
    new = (base.float() + 0.01 * torch.randn(1000)).to(torch.bfloat16)
    enc = encode_diff(new, base, spec, seed=3, **REF)
    assert torch.equal(enc.payload, encode(new.float() - base.float(), spec, seed=3, **REF).payload)
    target = base.clone()
    decode_add(enc, target, **REF)
    expect = (base.float() + _fp32_decode(enc)).to(torch.bfloat16)
    assert torch.equal(target, expect)
    # after the update the reconstruction is much closer to the new weights than before
    assert float((target.float() - new.float()).abs().max()) < 0.5 * float(
        (base.float() - new.float()).abs().max()
    )


def test_decode_sum_adds_in_order_and_accumulates():
    spec = QuantSpec(8, 64, "minmax", "stochastic", hadamard_block=32)
    xs = [heavy_tailed(777, seed=s) for s in range(3)]
    encs = [encode(x, spec, seed=1, stream=i, **REF) for i, x in enumerate(xs)]
    total = decode_sum(encs, 777, spec, **REF)
    assert total.dtype == torch.float32
    err = (total - sum(xs)).abs().max()
    assert float(err) < 3 * float(max(group_steps(x, spec).max() for x in xs)) * 2
    own = torch.randn(777)
    acc = own.clone()
    decode_sum(torch.stack([e.payload for e in encs]), 777, spec, out=acc, accumulate=True, **REF)
    assert torch.equal(acc, own + total)


def test_decode_sum_encode_is_the_two_hop_composition():
    intra = QuantSpec(8, 128, "absmax", "stochastic", hadamard_block=32)
    inter = QuantSpec(4, 128, "absmax", "stochastic", hadamard_block=32)
    xs = [heavy_tailed(1000, seed=s) for s in range(4)]
    encs = [encode(x, intra, stream=i, **REF) for i, x in enumerate(xs)]
    out = decode_sum_encode(encs, 1000, intra, inter, seed=2, stream=9, **REF)
    assert out.spec == inter and out.wire_bytes == inter.payload_bytes(1000)
    exact = sum(xs)
    got = decode(out, **REF)
    rel = float((got - exact).norm() / exact.norm())
    assert rel < 0.15, rel
    with pytest.raises(ValueError, match="same hadamard_block"):
        decode_sum_encode(encs, 1000, intra, QuantSpec(4, 128, "absmax", "stochastic"), **REF)
