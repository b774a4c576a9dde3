"""Global-QSGD's integer quantizer: the level rule makes carrier sums exact; codes are unbiased."""

import math

import pytest
import torch

from qsdp.quant import (
    global_int_decode,
    global_int_encode,
    global_int_levels,
    group_absmax,
)


@pytest.mark.parametrize(
    ("carrier", "n", "levels"),
    [
        ("int8", 1, 127),
        ("int8", 2, 63),
        ("int8", 3, 42),
        ("int8", 127, 1),
        ("fp16", 3, 682),
        ("fp16", 8, 256),
        ("int32", 1000, 2147483),
    ],
)
def test_level_rule(carrier, n, levels):
    assert global_int_levels(carrier, n) == levels


def test_level_rule_rejects_too_many_ranks():
    with pytest.raises(
        ValueError, match="128 ranks leave no quantization level; use carrier='fp16'"
    ):
        global_int_levels("int8", 128)
    with pytest.raises(ValueError, match="carrier='int4' must be one of"):
        global_int_levels("int4", 2)
    with pytest.raises(ValueError, match="world_size=0"):
        global_int_levels("int8", 0)


def _ranks_sum(xs, carrier, group, seed=0, rounding="stochastic"):
    n = len(xs)
    levels = global_int_levels(carrier, n)
    scales = torch.stack([group_absmax(x, group) for x in xs]).amax(0)  # the MAX all-reduce
    codes = [
        global_int_encode(
            x,
            scales,
            levels,
            carrier=carrier,
            group_size=group,
            seed=seed,
            stream=r,
            rounding=rounding,
        )
        for r, x in enumerate(xs)
    ]
    # what a SUM collective on the carrier computes, wrapping exactly like the wire would
    total = codes[0].clone()
    for c in codes[1:]:
        total += c
    return codes, total, scales, levels


@pytest.mark.parametrize("carrier", ["int8", "fp16"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_adversarial_sums_are_exact(carrier, n):
    g = 64
    cases = {
        "all at +max": [torch.full((300,), 3.0) for _ in range(n)],
        "all at -max": [torch.full((300,), -3.0) for _ in range(n)],
        "mixed signs": [torch.full((300,), 3.0 * (-1) ** r) for r in range(n)],
        "one rank huge": [torch.randn(300) * (1e6 if r == 0 else 1e-3) for r in range(n)],
    }
    for name, xs in cases.items():
        codes, total, scales, levels = _ranks_sum(xs, carrier, g)
        wide = torch.stack([c.to(torch.int64) for c in codes]).sum(0)
        assert torch.equal(total.to(torch.int64), wide), name  # no wrap, no fp16 rounding
        assert int(wide.abs().max()) <= n * levels
        if name == "all at +max":
            assert int(wide.min()) == n * levels  # the extreme really is reached


def test_int32_carrier_codes_stay_exact():
    # 2^31 - 1 levels would round to 2^31 in float32 and wrap to -2^31 on the cast.
    x = torch.tensor([-3.0, 3.0, 1.5])
    scales = group_absmax(x, 64)
    levels = global_int_levels("int32", 1)
    c = global_int_encode(x, scales, levels, carrier="int32", group_size=64, rounding="nearest")
    assert c.tolist() == [-(2**24), 2**24, 2**23]


def test_the_overflow_check_can_fail():
    # Without the level rule (127 levels for 3 ranks) the int8 sum wraps: the test would see it.
    x = torch.full((64,), 1.0)
    scales = group_absmax(x, 64)
    c = global_int_encode(x, scales, 127, carrier="int8", group_size=64)
    assert int((c + c + c)[0]) != 3 * 127


def test_mean_is_unbiased_over_seeds():
    n, g = 3, 32
    xs = [torch.randn(200) * (r + 1) for r in range(n)]
    exact = sum(xs) / n
    seeds = 1000
    acc = torch.zeros(200, dtype=torch.float64)
    for s in range(seeds):
        _, total, scales, levels = _ranks_sum(xs, "int8", g, seed=s)
        acc += global_int_decode(total, scales, levels, world_size=n, group_size=g).double()
    mean = acc / seeds
    step = (scales.repeat_interleave(g)[:200] / levels / n).double()
    # n independent roundings of variance <= 1/4 code^2 each, one code = step in the mean
    sd = step * math.sqrt(n) / 2 / math.sqrt(seeds)
    z = (mean - exact.double()).abs() / sd
    assert float(z.max()) < 5.0


def test_nearest_error_bound():
    n, g = 4, 128
    xs = [torch.randn(1000) for _ in range(n)]
    _, total, scales, levels = _ranks_sum(xs, "fp16", g, rounding="nearest")
    got = global_int_decode(total, scales, levels, world_size=n, group_size=g, op="sum")
    step = scales.repeat_interleave(g)[:1000] / levels
    assert bool(((got - sum(xs)).abs() <= n * 0.5 * step * (1 + 1e-5)).all())


def test_bad_inputs():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="scales has 1 groups"):
        global_int_encode(x, torch.ones(1), 10, group_size=64)
    x[3] = float("nan")
    scales = group_absmax(x, 64)
    assert scales[0] == float("inf")  # NaN becomes +inf, which survives a MAX all-reduce
    with pytest.raises(ValueError, match="1 of 2 groups hold NaN or Inf"):
        global_int_encode(x, scales, 10, group_size=64)
    with pytest.raises(ValueError, match="out must be a contiguous torch.int8 tensor of 10"):
        global_int_encode(torch.randn(10), torch.ones(1), 5, group_size=64, out=torch.empty(10))
    with pytest.raises(ValueError, match="group_size=100: the Triton kernel needs a power of two"):
        global_int_encode(torch.randn(10), torch.ones(1), 5, group_size=100, backend="triton")
    with pytest.raises(ValueError, match="levels=200 must be in"):
        global_int_encode(torch.randn(10), torch.ones(1), 200, carrier="int8", group_size=64)
    with pytest.raises(ValueError, match="op='max'"):
        global_int_decode(torch.zeros(10), torch.ones(1), 10, world_size=2, op="max")


@pytest.mark.parametrize("carrier", ["int8", "fp16", "int32"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("numel", [1, 1000, 2 * 4096, 4096 + 13])
def test_triton_kernel_bit_exact(carrier, rounding, numel):
    x = torch.randn(numel) * 3
    x[:5] = torch.tensor([3.0, -3.0, 0.0, 1e-30, -1e-30])[: min(5, numel)]
    scales = group_absmax(x, 128) * 1.5  # a global max above the local one
    levels = global_int_levels(carrier, 3)
    kw = dict(carrier=carrier, group_size=128, rounding=rounding, seed=7, step=2, stream=5)
    a = global_int_encode(x, scales, levels, backend="reference", **kw)
    b = global_int_encode(x.to(torch.bfloat16).float(), scales, levels, backend="reference", **kw)
    t = global_int_encode(x, scales, levels, backend="triton", **kw)
    assert t.dtype == a.dtype and torch.equal(t, a)
    tb = global_int_encode(x.to(torch.bfloat16), scales, levels, backend="triton", **kw)
    assert torch.equal(tb, b)
    assert int(a.to(torch.int64).abs().max()) <= levels


@pytest.mark.gpu
@pytest.mark.parametrize("carrier", ["int8", "fp16", "int32"])
def test_gpu_kernel_bit_exact(carrier):
    x = torch.randn((1 << 20) + 7, device="cuda")
    scales = group_absmax(x, 128)
    levels = global_int_levels(carrier, 4)
    kw = dict(carrier=carrier, group_size=128, seed=1, stream=3)
    a = global_int_encode(x, scales, levels, backend="reference", **kw)
    assert torch.equal(a, global_int_encode(x, scales, levels, backend="triton", **kw))
