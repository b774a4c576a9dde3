"""Tiny and subnormal values (issue 31): every finite input decodes within the documented bound.

The step of a group that is not constant is floored at ``STEP_FLOOR = 2^-126`` (the reference's
[Note: step floor]), so the bound is ``max(step, 2^-126) / 2`` with nearest rounding and
``max(step, 2^-126)`` with stochastic rounding, in the quantizer's (rotated) domain. Before the
floor a subnormal step's reciprocal overflowed: 8-bit minmax decoded -8.01e-38 as +3.41e-37,
shift-lattice refused the group, Global-QSGD's int32 codes became INT_MIN. Both backends, bit
for bit (Triton interpreted on CPU).
"""

import math

import pytest
import torch

from qsdp.quant import (
    STEP_FLOOR,
    QuantSpec,
    decode,
    decode_add,
    decode_sum,
    decode_sum_encode,
    encode,
    encode_diff,
    global_int_decode,
    global_int_encode,
    global_int_levels,
    group_absmax,
)
from qsdp.quant.reference import decode_sum_flat
from qsdp.testing import assert_within, dtype_slack, rounding_bound

from .helpers import BACKENDS, CASES, IDS, G, case_spec

SUB = 2.0**-149  # float32's smallest subnormal


def tiny_inputs(seed: int = 0) -> torch.Tensor:
    """Eight groups of ``G`` and an odd tail: subnormals with zeros and both signs; the smallest
    subnormals; tiny normals around the issue's -8.01e-38; tiny values beside a few normal ones;
    a narrow band far from zero (range of a few ulps of 1e-30); a constant tiny group; zeros;
    then 13 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    sub = torch.randint(-(2**23), 2**23, (G,), generator=gen).double() * SUB
    sub[::4] = 0.0
    smallest = torch.tensor([-SUB, 0.0, SUB, 2 * SUB], dtype=torch.float64).repeat(G // 4)
    normal = torch.randn(G, generator=gen, dtype=torch.float64) * 1e-37
    normal[0] = -8.01e-38
    mixed = torch.randn(G, generator=gen, dtype=torch.float64) * 1e-39
    mixed[[3, 17]] = torch.tensor([0.75, -2.5], dtype=torch.float64)
    band = 1e-30 + torch.randint(-4, 5, (G,), generator=gen).double() * 2.0**-123
    const = torch.full((G,), 3e-39, dtype=torch.float64)
    zeros = torch.zeros(G, dtype=torch.float64)
    tail = torch.randint(-(2**20), 2**20, (13,), generator=gen).double() * SUB
    return torch.cat((sub, smallest, normal, mixed, band, const, zeros, tail)).float()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    assert bool(same.all()), f"{int((~same).sum())} of {a.numel()} differ"


def _group_max(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Each element's group's largest ``|x|`` (float64): the decode's float32 rounding scales with
    it (``base + code * unit`` for an element near zero in a group reaching 2.5)."""
    n, g = x.numel(), spec.group_size
    padded = torch.zeros(spec.num_groups(n) * g, dtype=torch.float64)
    padded[:n] = x.reshape(-1).double().abs()
    return padded.reshape(-1, g).amax(dim=1).repeat_interleave(g)[:n]


def _check(x: torch.Tensor, y: torch.Tensor, spec: QuantSpec, what: str) -> None:
    """``y = decode(encode(x))`` within ``rounding_bound`` (the floored step) plus float32 and
    output-dtype rounding, in the rotated domain; absmax without Hadamard never flips a sign."""
    assert bool(torch.isfinite(y).all()), what
    x64 = x.double()
    assert_within(
        y.double() - x64,
        rounding_bound(x, spec),
        spec,
        slack=dtype_slack(_group_max(x, spec), y.dtype, spec),
        what=what,
    )
    if spec.scheme.value == "absmax" and not spec.hadamard_block:
        assert bool((torch.sign(y.double()) * torch.sign(x64) >= 0).all()), what


# --- encode / decode --------------------------------------------------------------------------
@pytest.mark.parametrize(("scheme", "bits", "rounding", "had"), CASES, ids=IDS)
def test_tiny_values_decode_within_the_floored_bound(scheme, bits, rounding, had):
    spec = case_spec(scheme, bits, rounding, had)
    x = tiny_inputs()
    ref = encode(x, spec, seed=3, step=1, stream=2, backend="reference")
    tri = encode(x, spec, seed=3, step=1, stream=2, backend="triton")
    _same(ref.payload, tri.payload)
    y = decode(ref, backend="reference")
    _same(y, decode(ref, backend="triton"))
    _check(x, y, spec, f"tiny {spec}")
    assert torch.equal(y[6 * G : 7 * G], x[6 * G : 7 * G])  # the all-zero group
    if scheme != "absmax" and not had:  # a constant group keeps a step of 0: exact
        assert torch.equal(y[5 * G : 6 * G], x[5 * G : 6 * G])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["absmax", "minmax", "shift-lattice"])
def test_half_inputs(dtype, scheme):
    # bf16 has float32's exponent range (its subnormals reach 9e-41); fp16 flushes these
    # inputs to zero and signed zeros, and its own subnormals start at 6e-8
    spec = case_spec(scheme, 4, "stochastic", 16)
    x = tiny_inputs(seed=1).to(dtype)
    if dtype == torch.float16:
        x = x + (torch.arange(x.numel()) % 7 - 3).to(dtype) * 6e-8
    ref = encode(x, spec, seed=5, backend="reference")
    _same(ref.payload, encode(x, spec, seed=5, backend="triton").payload)
    y = decode(ref, backend="reference")
    _same(y, decode(ref, backend="triton"))
    assert y.dtype == dtype
    _check(x.float(), y, spec, f"{dtype} {spec}")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_scales(bits, rounding):
    spec = case_spec("absmax", bits, rounding, None, scale_dtype=torch.bfloat16)
    x = tiny_inputs(seed=2)
    ref = encode(x, spec, seed=1, backend="reference")
    _same(ref.payload, encode(x, spec, seed=1, backend="triton").payload)
    _check(x, decode(ref, backend="reference"), spec, f"bf16 scales {spec}")


def test_the_issue_example():
    # 8-bit min-max: -8.01e-38 in a group of values around 1e-37 came back as +3.41e-37
    spec = case_spec("minmax", 8, "nearest", None)
    x = tiny_inputs()[2 * G : 3 * G]
    assert abs(float(x[0]) + 8.01e-38) < 1e-44
    for backend in BACKENDS:
        y = decode(encode(x, spec, backend=backend), backend=backend)
        assert float(y[0]) < 0
        assert abs(float(y[0]) - float(x[0])) <= STEP_FLOOR / 2


def test_stored_step_is_the_floor():
    # a tiny group stores exactly 2^-126; a constant or all-zero group keeps a step of 0
    x = torch.cat((torch.full((G,), 1e-40), torch.zeros(G), torch.tensor([0.0, 2e-45] * (G // 2))))
    for scheme in ("absmax", "minmax", "shift-lattice"):
        spec = case_spec(scheme, 8, "nearest", None)
        for backend in BACKENDS:
            enc = encode(x, spec, backend=backend)
            fields = enc.payload[: 3 * spec.scale_bytes].clone().view(torch.float32)
            steps = fields[spec.scale_fields - 1 :: spec.scale_fields].tolist()
            assert steps == [STEP_FLOOR if scheme == "absmax" else 0.0, 0.0, STEP_FLOOR], spec
            y = decode(enc, backend=backend)
            exact = slice(G, 2 * G) if scheme == "absmax" else slice(0, 2 * G)
            assert torch.equal(y[exact], x[exact])


@pytest.mark.parametrize("backend", BACKENDS)
def test_shift_lattice_tiny_range_encodes(backend):
    # delta = 1e-37 / 254 was subnormal: 1 / delta overflowed, the grid offset was NaN, and
    # encode refused the group ("range is too small"); now it encodes within the bound
    spec = case_spec("shift-lattice", 8, "nearest", None)
    x = torch.zeros(G + 3)
    x[0] = 1e-37
    y = decode(encode(x, spec, backend=backend), backend=backend)
    _check(x, y, spec, "shift-lattice 1e-37")


def test_stochastic_rounding_stays_unbiased():
    # the floor clips no code, so stochastic rounding of subnormals is still unbiased (a flush to
    # zero would not be)
    spec = case_spec("absmax", 2, "stochastic", None)
    x = tiny_inputs(seed=4)[:G]
    seeds = 400
    total = torch.zeros(G, dtype=torch.float64)
    for s in range(seeds):
        total += decode(encode(x, spec, seed=s, backend="reference"), backend="reference").double()
    z = (total / seeds - x.double()).abs() / (STEP_FLOOR / (2 * math.sqrt(seeds)))
    assert float(z.max()) < 5.0, float(z.max())


# --- fused ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("out_scheme", ["minmax", "shift-lattice"])
@pytest.mark.parametrize("had", [None, 16])
def test_decode_sum_encode_of_tiny_sums(out_scheme, had):
    in_spec = case_spec("absmax", 8, "nearest", had)
    out_spec = case_spec(out_scheme, 4, "stochastic", had)
    x = tiny_inputs(seed=6)
    n = x.numel()
    stacked = torch.stack([encode(x * (r + 1), in_spec, stream=r).payload for r in range(3)])
    total = decode_sum(stacked, n, in_spec, backend="reference")
    _same(total, decode_sum(stacked, n, in_spec, backend="triton"))
    r = decode_sum_encode(stacked, n, in_spec, out_spec, seed=4, backend="reference")
    t = decode_sum_encode(stacked, n, in_spec, out_spec, seed=4, backend="triton")
    _same(r.payload, t.payload)
    _same(decode(r, backend="reference"), decode(r, backend="triton"))
    # the hop re-quantizes the float32 sum in the rotated domain: its own bound there
    acc = decode_sum_flat(stacked, n, in_spec, rotate=False)
    y = decode_sum_flat(r.payload.reshape(1, -1), n, out_spec, rotate=False)
    err = (y.double() - acc.double()).abs()
    bound = rounding_bound(acc, out_spec, rotated=True)
    slack = dtype_slack(_group_max(acc, out_spec), torch.float32, None)
    assert bool((err <= bound + slack).all()), float((err - bound).max())


@pytest.mark.parametrize("scheme", ["absmax", "minmax"])
def test_weight_differences_of_tiny_values(scheme):
    spec = case_spec(scheme, 4, "stochastic", None, group=64)
    base = tiny_inputs(seed=7).to(torch.bfloat16)
    new = (tiny_inputs(seed=8) * 0.5).to(torch.bfloat16)
    a = encode_diff(new, base, spec, seed=4, backend="reference")
    _same(a.payload, encode_diff(new, base, spec, seed=4, backend="triton").payload)
    ta, tb = base.clone(), base.clone()
    decode_add(a, ta, backend="reference")
    decode_add(a, tb, backend="triton")
    _same(ta, tb)
    diff = new.float() - base.float()
    bound = rounding_bound(diff, spec)
    magnitude = _group_max(diff, spec) + new.double().abs() + base.double().abs()
    slack = dtype_slack(magnitude, torch.bfloat16, spec)
    err = ta.double() - new.double()
    assert bool((err.abs() <= bound + slack).all()), float((err.abs() - bound).max())


# --- Global-QSGD integers -----------------------------------------------------------------------
@pytest.mark.parametrize("carrier", ["int8", "fp16", "int32"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_global_int_tiny_values(carrier, rounding):
    g, n = 32, 3
    xs = [tiny_inputs(seed=10 + r) * (1 - 2 * (r % 2)) for r in range(n)]
    numel = xs[0].numel()
    levels = global_int_levels(carrier, n)
    scales = torch.stack([group_absmax(x, g) for x in xs]).amax(0)
    kw = dict(carrier=carrier, group_size=g, rounding=rounding, seed=2, step=1)
    codes = []
    for r, x in enumerate(xs):
        q = global_int_encode(x, scales, levels, stream=r, **kw)
        _same(q, global_int_encode(x, scales, levels, stream=r, backend="triton", **kw))
        assert int(q.to(torch.int64).abs().max()) <= levels
        codes.append(q.to(torch.int64))
    total = sum(codes)
    mean = global_int_decode(total, scales, levels, world_size=n, group_size=g)
    exact = sum(x.double() for x in xs) / n
    step = (scales.double() / levels).clamp(min=STEP_FLOOR).repeat_interleave(g)[:numel]
    bound = step * (0.5 if rounding == "nearest" else 1.0)
    # float32 scaling x * s / M (a few units of M * 2^-24 at 2^24 levels) and rounding
    m = scales.double().repeat_interleave(g)[:numel]
    slack = (m + exact.abs()) * 2.0**-22 + 4 * SUB
    err = (mean.double() - exact).abs()
    assert bool((err <= bound + slack).all()), float((err - bound).max())
    assert torch.equal(mean[6 * G : 7 * G], torch.zeros(G))  # the all-zero group stays zero
    if rounding == "nearest":  # one rank alone: never a flipped sign
        alone = global_int_decode(codes[0], scales, levels, world_size=1, group_size=g)
        assert bool((torch.sign(alone) * torch.sign(xs[0]) >= 0).all())


# --- compiled kernels ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("scheme", "bits", "rounding", "had"), CASES, ids=IDS)
def test_gpu_kernels_match_reference_on_tiny_values(scheme, bits, rounding, had):
    # compiled kernels may flush subnormals (libdevice's ftz division): the floor, conditioned on
    # the group's range rather than on the divided step, gives the same bytes
    spec = case_spec(scheme, bits, rounding, had, group=128)
    x = tiny_inputs().repeat(5).cuda()
    for v in (x, x.to(torch.bfloat16)):
        a = encode(v, spec, seed=5, stream=2, backend="reference")
        _same(a.payload, encode(v, spec, seed=5, stream=2, backend="triton").payload)
        y = decode(a, backend="reference")
        _same(y, decode(a, backend="triton"))
        _check(v.float().cpu(), y.cpu(), spec, f"gpu tiny {spec}")
    levels = global_int_levels("int32", 2)
    scales = group_absmax(x, 128)
    kw = dict(carrier="int32", group_size=128, rounding=rounding, seed=1, stream=3)
    _same(
        global_int_encode(x, scales, levels, **kw, backend="reference"),
        global_int_encode(x, scales, levels, **kw, backend="triton"),
    )
