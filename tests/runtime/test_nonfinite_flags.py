"""``nonfinite_flags`` (one fused pass of the largest magnitudes) against the plain definition
(every element checked), on adversarial inputs: NaN, +-Inf, values at and just above the
quantizer's limit, bf16 and fp32, one and three rows, an empty parameter, layouts that do and do
not match."""

from __future__ import annotations

import itertools

import pytest
import torch

from qsdp.runtime import nonfinite_flags

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


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [float("inf"), 7.5])
def test_flags_match_the_definition(world, dtype, limit):
    g = torch.Generator().manual_seed(world)
    flagged = 0
    bad_values = (float("nan"), float("inf"), -float("inf"), 7.5, -7.51, 100.0, None)
    for value, where in itertools.product(bad_values, range(0, 56 * world, 5)):
        x = torch.randn(world, sum(SIZES), generator=g).to(dtype)
        if value is not None:
            x.view(-1)[where % x.numel()] = value
        for layout in (LAYOUT, None, LAYOUT[:-1]):
            got = nonfinite_flags(x, layout, limit)
            assert torch.equal(got, _by_definition(x, layout, limit)), (value, where, layout)
            flagged += int(got.sum())
    assert flagged > 0  # the cases flag something


def test_one_flag_per_parameter_in_the_right_place():
    x = torch.zeros(3, sum(SIZES))
    x[2, 5 + 17] = float("nan")  # row 2, the single-element parameter p3
    assert nonfinite_flags(x, LAYOUT).tolist() == [0, 0, 0, 1, 0]
    x[0, 4] = float("inf")  # row 0, p0's last element
    assert nonfinite_flags(x, LAYOUT).tolist() == [1, 0, 0, 1, 0]


def test_zero_where_fills_one_span_of_a_shared_buffer_and_nothing_beyond():
    from qsdp.runtime.nonfinite import _one_span, zero_where

    buffer = torch.arange(1.0, 13.0)  # FSDP2's reduce-scatter output: views with padding
    a, b = buffer[2:5], buffer[6:10].view(2, 2)
    span = _one_span([a, b])
    assert span is not None and span.data_ptr() == a.data_ptr() and span.numel() == 8
    zero_where(torch.tensor(False), [a, b])
    assert torch.equal(buffer, torch.arange(1.0, 13.0))  # not flagged: untouched
    zero_where(torch.tensor(True), [a, b])
    assert not a.any() and not b.any()
    assert torch.equal(buffer[:2], torch.tensor([1.0, 2.0]))  # outside the span: kept
    assert torch.equal(buffer[10:], torch.tensor([11.0, 12.0]))
    # separate tensors (accumulated gradients), or another dtype: one fill each
    c, d = torch.ones(3), torch.ones(2)
    assert _one_span([c, d]) is None
    assert _one_span([buffer[0:2], buffer.double()[2:4]]) is None
    zero_where(torch.tensor(True), [c, d])
    assert not c.any() and not d.any()
