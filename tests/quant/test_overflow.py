"""Huge finite values (issue #10, item 5): a payload never decodes to NaN or Inf by overflow.

Each group either decodes finite within its error bound or is flagged like a NaN group: encode
raises naming the group count, the largest |x|, the limit and the fix, or with
``nonfinite="propagate"`` sends the group as NaN. Limits: ``QuantSpec.value_limit()`` and the
reference's [Note: representable range]. Both backends, bit for bit (Triton interpreted on CPU).
"""

import pytest
import torch

from qsdp.quant import (
    QuantSpec,
    Scheme,
    decode,
    decode_add,
    decode_rows,
    decode_sum,
    decode_sum_encode,
    encode,
    encode_diff,
    global_int_decode,
    global_int_encode,
    global_int_levels,
    group_absmax,
)
from qsdp.quant.hadamard import hadamard_forward, hadamard_inverse
from qsdp.quant.reference import unpack_codes

from .helpers import BACKENDS, CASES, IDS, G, case_spec, group_steps

FMAX = torch.finfo(torch.float32).max


def _any_finite(spec: QuantSpec) -> bool:
    """Whether ``spec`` encodes every finite value (absmax without Hadamard)."""
    return spec.scheme is Scheme.ABSMAX and not spec.hadamard_block


def _huge(n: int = G + 5) -> torch.Tensor:
    """``[3e38, -3e38, 0, ...]`` in group 0, ordinary values in a short tail group."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[:G] = 0.0
    x[0], x[1] = 3e38, -3e38
    return x


def _near_limit(limit: float) -> torch.Tensor:
    """Groups at the limit: +-limit and a ramp, a constant, a narrow band, alternating signs,
    and a short tail (a Hadamard block of equal values rotates into one value sqrt(h) larger)."""
    gen = torch.Generator().manual_seed(5)
    ramp = torch.linspace(-1.0, 1.0, G)
    ramp[0], ramp[1] = 1.0, -1.0
    parts = [
        ramp,
        torch.ones(G),
        1.0 - 1e-3 * torch.rand(G, generator=gen),
        torch.tensor([1.0, -1.0]).repeat(G // 2),
        torch.tensor([1.0, -1.0, 1.0, 0.5, -1.0]),
    ]
    return torch.cat(parts) * limit


def _fields(payload: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    ng = spec.num_groups(numel)
    raw = payload[: ng * spec.scale_bytes].clone()
    return raw.view(spec.scale_dtype).float().reshape(ng, spec.scale_fields)


def _codes(payload: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    sb = spec.num_groups(numel) * spec.scale_bytes
    return unpack_codes(payload[sb:], numel, spec.bits)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    assert bool(same.all()), f"{int((~same).sum())} of {a.numel()} differ"


def _assert_flagged(payload: torch.Tensor, numel: int, spec: QuantSpec, groups: list[int]):
    """Exactly ``groups`` carry the flag (NaN first field, zero second field, zero codes)."""
    fields = _fields(payload, numel, spec)
    flagged = torch.isnan(fields[:, 0]).nonzero().reshape(-1).tolist()
    assert flagged == groups
    assert bool((fields[groups, 1:] == 0).all())
    codes = _codes(payload, numel, spec)
    for g in groups:
        assert int(codes[g * G : (g + 1) * G].abs().sum()) == 0


def _assert_within_bound(x: torch.Tensor, y: torch.Tensor, spec: QuantSpec) -> None:
    """Per element for plain specs; for Hadamard, the L2 norm of the error (the rotation is
    orthonormal, so it equals the rotated-domain error, bounded per element there)."""
    assert bool(torch.isfinite(y).all())
    half = 0.5 if spec.rounding.value == "nearest" else 1.0
    if not spec.hadamard_block:
        step = group_steps(x, spec)
        # float32 rounding of x - base and base + code * unit: a few ulps of |x| (as
        # test_numerics allows)
        assert bool(((y - x).abs() <= half * step * (1 + 1e-5) + 1e-6 * x.abs()).all())
        return
    step = group_steps(hadamard_forward(x, spec), spec).double()
    bound = float((half * step).pow(2).sum().sqrt()) * (1 + 1e-4)
    slack = 1e-5 * float(x.double().norm())
    assert float((y.double() - x.double()).norm()) <= bound + slack


# --- encode / decode --------------------------------------------------------------------------
@pytest.mark.parametrize(("scheme", "bits", "rounding", "had"), CASES, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_values_decode_within_bound_or_raise(scheme, bits, rounding, had, backend):
    spec = case_spec(scheme, bits, rounding, had)
    x = _huge()
    if _any_finite(spec):
        y = decode(encode(x, spec, seed=1, backend=backend), backend=backend)
        _assert_within_bound(x, y, spec)
        return
    with pytest.raises(ValueError) as err:
        encode(x, spec, seed=1, backend=backend)
    msg = str(err.value)
    assert "1 of 2 groups hold finite values too large for" in msg
    assert "largest |x| = 3e+38" in msg
    assert f"every |x| <= {spec.value_limit():.4g}" in msg
    assert "scale the tensor down" in msg and "nonfinite='propagate'" in msg
    fix = "hadamard_block=None" if had else "scheme='absmax'"
    assert fix in msg
    assert "NaN or Inf" not in msg  # the old, misleading "0 of 37 values are NaN or Inf"


@pytest.mark.parametrize(("scheme", "bits", "rounding", "had"), CASES, ids=IDS)
def test_propagate_flags_the_group_bit_exact(scheme, bits, rounding, had):
    spec = case_spec(scheme, bits, rounding, had, nonfinite="propagate")
    x = _huge()
    n = x.numel()
    a = encode(x, spec, seed=3, step=2, stream=1, backend="reference")
    b = encode(x, spec, seed=3, step=2, stream=1, backend="triton")
    _same(a.payload, b.payload)
    y = decode(a, backend="reference")
    _same(y, decode(a, backend="triton"))
    if _any_finite(spec):
        _assert_flagged(a.payload, n, spec, [])
        _assert_within_bound(x, y, spec)
        return
    _assert_flagged(a.payload, n, spec, [0])
    assert bool(torch.isnan(y[:G]).all())  # the whole group arrives as NaN, not garbage
    tail = QuantSpec(bits, G, scheme, rounding)  # the tail group is not rotated (5 < h)
    _assert_within_bound(x[G:], y[G:], tail)


@pytest.mark.parametrize(("scheme", "bits", "rounding", "had"), CASES, ids=IDS)
def test_values_at_the_documented_limit_decode(scheme, bits, rounding, had):
    spec = case_spec(scheme, bits, rounding, had)
    limit = spec.value_limit()
    x = _near_limit(FMAX if limit == float("inf") else limit)
    a = encode(x, spec, seed=7, backend="reference")  # raises if a group were flagged
    _same(a.payload, encode(x, spec, seed=7, backend="triton").payload)
    y = decode(a, backend="reference")
    _same(y, decode(a, backend="triton"))
    _assert_within_bound(x, y, spec)


@pytest.mark.parametrize("had", [None, 16])
def test_bf16_flagged_group_bit_exact(had):
    # the flag's NaN is stored as 0x7FC0 by both backends (torch's own float32 -> bf16 cast of
    # NaN gives 0xFFFF on CPU)
    spec = case_spec("absmax", 4, "nearest", had, scale_dtype=torch.bfloat16, nonfinite="propagate")
    x = _huge()
    x[G + 2] = float("nan")
    a = encode(x, spec, backend="reference")
    _same(a.payload, encode(x, spec, backend="triton").payload)
    group1 = a.payload[2:4].clone().view(torch.int16)  # one bf16 field per group
    assert int(group1) & 0xFFFF == 0x7FC0
    _assert_flagged(a.payload, x.numel(), spec, [1] if not had else [0, 1])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bf16_absmax_scales_at_the_float32_maximum(bits, rounding):
    # rounding the step up to bf16 passed bf16's maximum (2-bit) or qmax * s overflowed
    spec = QuantSpec(bits, G, "absmax", rounding, scale_dtype=torch.bfloat16)
    x = _near_limit(FMAX)
    a = encode(x, spec, seed=2, backend="reference")
    _same(a.payload, encode(x, spec, seed=2, backend="triton").payload)
    y = decode(a, backend="triton")
    _same(y, decode(a, backend="reference"))
    _assert_within_bound(x, y, spec)


def test_beyond_the_limit_only_real_overflow_is_refused():
    # minmax's limit is 2^126, but a group whose decoded range fits float32 still encodes
    spec = case_spec("minmax", 8, "nearest", None)
    x = torch.full((G,), 2.0**127)
    x[1] = 2.0**126
    _assert_within_bound(x, decode(encode(x, spec, backend="reference")), spec)
    x[1] = -(2.0**127)  # max - min = 2^128: past float32
    with pytest.raises(ValueError, match="1 of 1 groups hold finite values too large"):
        encode(x, spec, backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inverse_rotation_keeps_its_headroom(backend):
    # x = [a, a/4, 0, ...] rotates (h=16) finite, to (a +- a/4) / 4; 2-bit nearest rounds both
    # to the same step M = 5a/16, and the inverse butterflies add 16 M = 2.5 * FLT_MAX: without
    # the 2h headroom the group would decode to Inf
    spec = case_spec("absmax", 2, "nearest", 16, nonfinite="propagate")
    x = torch.zeros(G + 3)
    x[0], x[1] = 0.5 * FMAX, 0.125 * FMAX
    assert bool(torch.isfinite(hadamard_forward(x, spec)).all())
    enc = encode(x, spec, backend=backend)
    _assert_flagged(enc.payload, x.numel(), spec, [0])
    y = decode(enc, backend=backend)
    assert bool(torch.isnan(y[:G]).all()) and bool((y[G:] == 0).all())
    x /= 2 * 16  # within the headroom: decodes, and the step rounding is visible
    y = decode(encode(x, spec, backend=backend), backend=backend)
    assert bool(torch.isfinite(y).all()) and float(y[0]) > float(x[0])
    _assert_within_bound(x, y, spec)


def test_nan_and_too_large_in_one_tensor_name_both():
    spec = case_spec("shift-lattice", 4, "nearest", None)
    x = torch.randn(2 * G + 3)
    x[0], x[1] = 3e38, -3e38
    x[G + 4] = float("nan")
    for backend in BACKENDS:
        with pytest.raises(
            ValueError,
            match=r"1 of 67 values are NaN or Inf.*also too large for this scheme: 1 group",
        ):
            encode(x, spec, backend=backend)


# --- fused ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("had", [None, 16])
def test_decode_sum_and_rows_of_payloads_at_the_limit(had):
    spec = case_spec("shift-lattice", 4, "stochastic", had, nonfinite="propagate")
    k = 3
    x = _near_limit(spec.value_limit() / k)
    n = x.numel()
    bad = _huge(n)  # one row carries a flagged group
    rows = [encode(x * (-1) ** r, spec, stream=r, backend="reference") for r in range(k)]
    rows.append(encode(bad, spec, backend="reference"))
    stacked = torch.stack([e.payload for e in rows])
    total = decode_sum(stacked[:k], n, spec, backend="reference")
    _same(total, decode_sum(stacked[:k], n, spec, backend="triton"))
    assert bool(torch.isfinite(total).all())
    ref = decode_rows(stacked, n, spec, backend="reference")
    _same(ref, decode_rows(stacked, n, spec, backend="triton"))
    assert bool(torch.isfinite(ref[:k]).all())
    assert bool(torch.isnan(ref[k, :G]).all()) and bool(torch.isfinite(ref[k, G:]).all())


@pytest.mark.parametrize("had", [None, 16])
def test_decode_sum_encode_flags_a_sum_too_large(had):
    # Each payload decodes finite (absmax); the sum of two stays finite too, but its range is
    # past what the minmax out spec can decode: max - min passes float32 (no Hadamard), or
    # 2h times the largest value does (h=16). That group is flagged, never a NaN step.
    in_spec = case_spec("absmax", 8, "nearest", had)
    out_spec = case_spec("minmax", 4, "stochastic", had)
    n = 2 * G + 3
    y = torch.randn(n, generator=torch.Generator().manual_seed(1))  # the rotated domain
    y[:G] = torch.linspace(-1.0, 1.0, G) * (0.6 * FMAX / 32 if had else 0.3 * FMAX)
    x = hadamard_inverse(y, in_spec) if had else y
    stacked = torch.stack([encode(x, in_spec, stream=r).payload for r in range(2)])
    sums = decode_sum_encode(stacked, n, in_spec, out_spec, seed=4, backend="reference")
    tri = decode_sum_encode(stacked, n, in_spec, out_spec, seed=4, backend="triton")
    _same(sums.payload, tri.payload)
    _assert_flagged(sums.payload, n, out_spec, [0])
    out = decode(sums, backend="reference")
    _same(out, decode(sums, backend="triton"))
    assert bool(torch.isnan(out[:G]).all()) and bool(torch.isfinite(out[G:]).all())
    # the same sums one step lower fit: nothing flagged
    half = torch.stack([encode(x / 2, in_spec, stream=r).payload for r in range(2)])
    ok = decode_sum_encode(half, n, in_spec, out_spec, seed=4, backend="triton")
    _assert_flagged(ok.payload, n, out_spec, [])
    assert bool(torch.isfinite(decode(ok, backend="reference")).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_difference_too_large_or_overflowing(backend):
    spec = case_spec("minmax", 4, "nearest", None)
    x = torch.tensor([2e38, -2e38, 1.0])
    base = torch.tensor([-1e38, 1e38, 1.0])  # x - base = +-3e38: finite, too large for minmax
    with pytest.raises(ValueError, match=r"largest \|x - base\| = 3e\+38"):
        encode_diff(x, base, spec, backend=backend)
    x, base = torch.tensor([3e38, 1.0]), torch.tensor([-3e38, 1.0])  # x - base = inf
    with pytest.raises(ValueError, match="x - base overflows float32 in 1 of 2 values"):
        encode_diff(x, base, spec, backend=backend)


@pytest.mark.parametrize("had", [None, 16])
def test_weight_difference_at_the_limit_bit_exact(had):
    spec = case_spec("shift-lattice", 8, "stochastic", had)
    limit = spec.value_limit()
    diff = _near_limit(limit)
    base = torch.randn(diff.numel()) * (limit / 4)
    new = base + diff
    a = encode_diff(new, base, spec, seed=9, backend="reference")
    _same(a.payload, encode_diff(new, base, spec, seed=9, backend="triton").payload)
    ta, tb = base.clone(), base.clone()
    decode_add(a, ta, backend="reference")
    decode_add(a, tb, backend="triton")
    _same(ta, tb)
    _assert_within_bound(new - base, ta - base, spec)


# --- Global-QSGD integers -----------------------------------------------------------------------
@pytest.mark.parametrize("carrier", ["int8", "fp16", "int32"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_global_int_mean_near_the_float32_maximum(carrier, n):
    # sum(q) * M / (s * n) passed float32 for two ranks at M = 3e38 before the ratio came first
    g = 64
    xs = [torch.full((G + 5,), 3e38 * (1 - 0.01 * r)) for r in range(n)]
    xs[0][3] = FMAX
    xs[-1][4] = -FMAX
    levels = global_int_levels(carrier, n)
    scales = torch.stack([group_absmax(x, g) for x in xs]).amax(0)
    kw = dict(carrier=carrier, group_size=g, rounding="nearest")
    codes = [global_int_encode(x, scales, levels, **kw) for x in xs]
    for x, c in zip(xs, codes, strict=True):
        assert torch.equal(c, global_int_encode(x, scales, levels, backend="triton", **kw))
    total = torch.stack([c.to(torch.int64) for c in codes]).sum(0)
    mean = global_int_decode(total, scales, levels, world_size=n, group_size=g)
    assert bool(torch.isfinite(mean).all())
    exact = torch.stack([x.double() for x in xs]).mean(0)
    step = float(scales.max()) / levels
    err = (mean.double() - exact).abs()
    assert bool((err <= 0.5 * step * (1 + 1e-5) + 1e-6 * exact.abs()).all())  # + float32 ulps
    total_sum = global_int_decode(total, scales, levels, world_size=n, group_size=g, op="sum")
    assert bool(torch.isinf(total_sum[:3]).all())  # the sum itself leaves float32: inf, not NaN
    assert not bool(torch.isnan(total_sum).any())


# --- compiled kernels ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("scheme", "bits", "rounding", "had"), CASES, ids=IDS)
def test_gpu_kernels_match_reference_at_the_range_edges(scheme, bits, rounding, had):
    spec = case_spec(scheme, bits, rounding, had, nonfinite="propagate", group=128)
    limit = spec.value_limit()
    huge = torch.zeros(3 * 128 + 5)
    huge[0], huge[1], huge[200] = 3e38, -3e38, FMAX
    near = _near_limit(FMAX if limit == float("inf") else limit).repeat(4)
    for x in (huge, near, torch.cat((near, huge))):
        x = x.cuda()
        a = encode(x, spec, seed=5, stream=2, backend="reference")
        _same(a.payload, encode(x, spec, seed=5, stream=2, backend="triton").payload)
        y = decode(a, backend="reference")
        _same(y, decode(a, backend="triton"))
        assert not bool(torch.isinf(y).any())
    stacked = torch.stack([encode(near.cuda() * 0.6, spec, stream=r).payload for r in range(2)])
    out_spec = case_spec("minmax", 4, rounding, had, group=128)
    n = near.numel()
    r = decode_sum_encode(stacked, n, spec, out_spec, seed=1, backend="reference")
    _same(
        r.payload, decode_sum_encode(stacked, n, spec, out_spec, seed=1, backend="triton").payload
    )
