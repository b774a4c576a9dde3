"""``nonfinite_flags`` (``qsdp.quant.run_flags``: the reference's one fused pass of the largest
magnitudes, and the Triton kernel, interpreted on the CPU) against the plain definition (every
element checked), on adversarial inputs: NaN, +-Inf, values at and just above the quantizer's
limit, bf16 and fp32, one and three rows, an empty parameter, layouts that do and do not match,
many runs and rows longer than a kernel program's block."""

from __future__ import annotations

import itertools

import pytest
import torch

from qsdp.quant import run_flags
from qsdp.runtime import nonfinite_flags

BACKENDS = ["reference", "triton"]

SIZES = [5, 0, 17, 1, 33]  # an empty run, a single element, odd lengths
LAYOUT = [(f"p{i}", n) for i, n in enumerate(SIZES)]


def _by_definition(chunks: torch.Tensor, layout, limit: float) -> torch.Tensor:
    if limit == float("inf"):
        bad = (~torch.isfinite(chunks)).any(dim=0)
    else:
        bad = (~(chunks.abs() <= limit)).any(dim=0)
    if layout is None or sum(n for _, n in layout) != bad.numel():
        return bad.any().reshape(1).to(torch.int32)
    return torch.stack([s.any() for s in torch.split(bad, [n for _, n in layout])]).to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [float("inf"), 7.5])
def test_flags_match_the_definition(world, dtype, limit, backend):
    g = torch.Generator().manual_seed(world)
    flagged = 0
    bad_values = (float("nan"), float("inf"), -float("inf"), 7.5, -7.51, 100.0, None)
    every = 5 if backend == "reference" else 13  # (the interpreted kernel: fewer places)
    for value, where in itertools.product(bad_values, range(0, 56 * world, every)):
        x = torch.randn(world, sum(SIZES), generator=g).to(dtype)
        if value is not None:
            x.view(-1)[where % x.numel()] = value
        # (a layout that does not match is one run, as None: the kernel is called alike, so
        # only the reference's cases try it)
        for layout in (LAYOUT, None, LAYOUT[:-1])[: 3 if backend == "reference" else 2]:
            got = nonfinite_flags(x, layout, limit, backend=backend)
            assert torch.equal(got, _by_definition(x, layout, limit)), (value, where, layout)
            flagged += int(got.sum())
    assert flagged > 0  # the cases flag something


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_flag_per_parameter_in_the_right_place(backend):
    x = torch.zeros(3, sum(SIZES))
    x[2, 5 + 17] = float("nan")  # row 2, the single-element parameter p3
    assert nonfinite_flags(x, LAYOUT, backend=backend).tolist() == [0, 0, 0, 1, 0]
    x[0, 4] = float("inf")  # row 0, p0's last element
    assert nonfinite_flags(x, LAYOUT, backend=backend).tolist() == [1, 0, 0, 1, 0]


def test_kernel_finds_the_run_among_many_across_blocks():
    """37 runs (empty ones among them, runs shorter and longer than the kernel's 2048-column
    block), 2 rows, a strided row view: every other run flagged at once, at its first or its
    last element (NaN or Inf, in either row), so that each flagged run's neighbours are clean
    and any flag that leaks past a run's ends, or is kept per block rather than per run, shows;
    then the other half. With an infinite limit and a finite one past float16's range; the
    kernel's flags equal the reference's and the definition's."""
    g = torch.Generator().manual_seed(5)
    sizes = [int(n) for n in torch.randint(0, 300, (37,), generator=g)]
    sizes[3], sizes[10], sizes[20] = 0, 5000, 2100
    total = sum(sizes)
    base = torch.randn(2, total + 7, generator=g).half()[:, 3 : 3 + total]  # a row stride
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    placed = set()
    for parity, end in itertools.product((0, 1), (0, 1)):
        x, want = base.clone(), [0] * len(sizes)
        for p, (at, n) in enumerate(zip(starts, sizes, strict=True)):
            if n and p % 2 == parity:
                x[p % 2, at + end * (n - 1)] = float("nan") if p % 3 else float("inf")
                want[p] = 1
                placed.add((p, at + end * (n - 1)))
        for limit in (float("inf"), 1e30):
            got = run_flags(x, sizes, limit=limit, backend="triton")
            assert got.tolist() == want, (parity, end, limit)
            assert torch.equal(got, run_flags(x, sizes, limit=limit, backend="reference"))
    # each non-empty run's first and last element were bad in one case
    assert len(placed) == 2 * sum(1 for n in sizes if n > 1) + sum(1 for n in sizes if n == 1)
    assert not run_flags(base, sizes, backend="triton").any()


def test_run_flags_refuses_rows_that_do_not_match_the_runs():
    with pytest.raises(ValueError, match=r"must be \[k, 10\] with unit column stride"):
        run_flags(torch.zeros(2, 9), [4, 6])
    with pytest.raises(ValueError, match="unit column stride"):
        run_flags(torch.zeros(10, 2).t(), [4, 6])


def test_zero_groups_fills_one_span_of_a_shared_buffer_and_nothing_beyond():
    from qsdp.runtime.nonfinite import _one_span, zero_groups

    buffer = torch.arange(1.0, 13.0)  # FSDP2's reduce-scatter output: views with padding
    a, b = buffer[2:5], buffer[6:10].view(2, 2)
    span = _one_span([a, b])
    assert span is not None and span.data_ptr() == a.data_ptr() and span.numel() == 8
    zero_groups(torch.tensor([0], dtype=torch.int32), [[a, b]])
    assert torch.equal(buffer, torch.arange(1.0, 13.0))  # not flagged: untouched
    zero_groups(torch.tensor([1], dtype=torch.int32), [[a, b]])
    assert not a.any() and not b.any()
    assert torch.equal(buffer[:2], torch.tensor([1.0, 2.0]))  # outside the span: kept
    assert torch.equal(buffer[10:], torch.tensor([11.0, 12.0]))
    # separate tensors (accumulated gradients), or another dtype: each on its own
    c, d = torch.ones(3), torch.ones(2)
    assert _one_span([c, d]) is None
    assert _one_span([buffer[0:2], buffer.double()[2:4]]) is None
    zero_groups(torch.tensor([1], dtype=torch.int32), [[c, d]])
    assert not c.any() and not d.any()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_zero_groups_zeroes_only_the_flagged_groups(backend, monkeypatch):
    """Several groups in one call (the Triton path: one launch per element size), each by its
    own flag: float32 spans, a bf16 one, a strided gradient (the reference), an empty group."""
    from qsdp.quant import flags as qflags
    from qsdp.runtime import nonfinite

    if backend == "triton":  # (the CPU's "auto" is the reference: force the kernel)
        monkeypatch.setattr(
            nonfinite,
            "zero_flagged_each",
            lambda xs, bad, which: qflags.zero_flagged_each(xs, bad, which, backend="triton"),
        )
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(40, generator=g) for _ in range(3)]
    half = torch.randn(10, generator=g).to(torch.bfloat16)
    wide = torch.randn(4, 6, generator=g)
    strided = wide.t()  # not contiguous
    groups = [
        [shards[0][1:9], shards[0][10:30]],
        [shards[1][:40]],
        [half],
        [shards[2][5:7], strided],
        [],
    ]
    before = [t.clone() for t in (*shards, half, wide)]
    bad = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
    nonfinite.zero_groups(bad, groups)
    s0, s1, s2 = before[:3]
    assert not shards[0][1:30].any()  # (the span's padding, element 9, included)
    assert shards[0][0] == s0[0] and torch.equal(shards[0][30:], s0[30:])
    assert torch.equal(shards[1], s1)  # clear: untouched
    assert not half.any()
    assert not shards[2][5:7].any() and torch.equal(shards[2][:5], s2[:5])
    assert torch.equal(shards[2][7:], s2[7:]) and not wide.any()


def test_zero_flagged_each_names_bad_inputs():
    from qsdp.quant import zero_flagged_each

    x, flags = torch.ones(4), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="1 tensors but 2 flag indices"):
        zero_flagged_each([x], flags, [0, 1])
    with pytest.raises(ValueError, match=r"flag indices \[2\] outside the 2 flags"):
        zero_flagged_each([x], flags, [2])
    with pytest.raises(ValueError, match="1-D int32, uint8 or bool, got torch.float32"):
        zero_flagged_each([x], flags.float(), [0])
    with pytest.raises(ValueError, match=r"xs\[0\] are not"):
        zero_flagged_each([torch.ones(3, 2).t()], flags, [0], backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_run_flags_writes_into_a_given_word(backend):
    # (a replayed check's persistent flag word: zeroed and set in place, the same word back)
    x = torch.ones(1, 9)
    out = torch.full((2,), 7, dtype=torch.int32)
    assert run_flags(x, [4, 5], out=out, backend=backend) is out
    assert out.tolist() == [0, 0]
    x[0, 6] = float("nan")
    run_flags(x, [4, 5], out=out, backend=backend)
    assert out.tolist() == [0, 1]
    for bad in (torch.zeros(2), torch.zeros(3, dtype=torch.int32), torch.zeros(1, 2).int()):
        with pytest.raises(ValueError, match=r"out must be int32 \[2\]"):
            run_flags(x, [4, 5], out=bad, backend=backend)
