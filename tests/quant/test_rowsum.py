"""``sum_rows_finish``: the Triton kernel against the torch reference, bit for bit (interpreted
on the CPU, compiled on a GPU), the reference against float64 sums, and the bad inputs."""

import pytest
import torch

from qsdp.quant import QuantSpec, decode_sum_finish, sum_rows_finish

from .helpers import heavy_tailed

# runs of a 40-element output, in order; the summed values land at these places
PLACES = ((1, 3), (7, 10), (20, 1), (25, 9))
N = sum(n for _, n in PLACES)


def _inputs(k, dtype, device="cpu", n=N, pad=5):
    """``k`` rows inside wider rows (strided, as the raw part of received rows), and a base."""
    wide = torch.stack([heavy_tailed(n + pad, seed=s) for s in range(max(k, 1))])
    rows = wide.to(dtype)[:k, :n].to(device)
    base = heavy_tailed(n, seed=99).to(dtype).to(device)
    return rows, base


def _run(rows, base, out_dtype, places, divisor, backend, fill=7.0):
    size = max(s + n for s, n in places) + 3
    out = torch.full((size,), fill, dtype=out_dtype, device=base.device)
    sum_rows_finish(rows, base=base, out=out, places=places, divisor=divisor, backend=backend)
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divisor", [None, 3])
def test_kernel_gives_the_reference_bits(k, dtype, divisor):
    rows, base = _inputs(k, dtype)
    assert rows.stride(0) != rows.shape[1] or k <= 1  # strided rows
    ref = _run(rows, base, dtype, PLACES, divisor, "reference")
    tri = _run(rows, base, dtype, PLACES, divisor, "triton")
    assert torch.equal(ref.view(torch.int8), tri.view(torch.int8))


def test_reference_is_the_float32_sum_in_order_at_the_places():
    rows, base = _inputs(3, torch.float32)
    out = _run(rows, base, torch.float32, PLACES, 4, "reference", fill=-1.0)
    acc = base.clone()
    for r in rows:
        acc = acc + r
    want = acc / 4
    exact = (base.double() + rows.double().sum(0)) / 4
    at = 0
    covered = torch.zeros(out.numel(), dtype=torch.bool)
    for s, n in PLACES:
        assert torch.equal(out[s : s + n], want[at : at + n])
        torch.testing.assert_close(out[s : s + n].double(), exact[at : at + n])
        covered[s : s + n] = True
        at += n
    assert (out[~covered] == -1.0).all()  # nothing written outside the places


def test_long_input_across_programs():
    """More elements than one program holds, runs crossing program boundaries."""
    places = ((0, 1500), (1600, 700), (2400, 2000))
    n = sum(k for _, k in places)
    rows, base = _inputs(2, torch.float32, n=n)
    ref = _run(rows, base, torch.bfloat16, places, 2, "reference")
    tri = _run(rows, base, torch.bfloat16, places, 2, "triton")
    assert torch.equal(ref.view(torch.int16), tri.view(torch.int16))


def test_bad_inputs_are_refused():
    rows, base = _inputs(2, torch.float32)
    out = torch.zeros(40)
    with pytest.raises(ValueError, match="covering"):
        sum_rows_finish(rows, base=base, out=out, places=((0, 3),))
    with pytest.raises(ValueError, match="inside out"):
        sum_rows_finish(rows, base=base, out=out, places=((30, N),))
    # out of order, or overlapping: refused on both backends, as decode_sum_finish does
    unordered, overlapping = PLACES[1:2] + PLACES[:1] + PLACES[2:], ((0, 10), (5, 13))
    for places in (unordered, overlapping):
        for backend in ("reference", "triton"):
            with pytest.raises(ValueError, match="in order, not overlapping"):
                sum_rows_finish(rows, base=base, out=out, places=places, backend=backend)
    spec = QuantSpec(bits=8, group_size=16, scheme="absmax", rounding="nearest")
    payloads = torch.zeros(1, spec.payload_bytes(N), dtype=torch.uint8)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="in order, not overlapping"):
            decode_sum_finish(
                payloads, N, spec, base=base, out=out, runs=unordered, backend=backend
            )
    with pytest.raises(ValueError, match="unit column stride"):
        sum_rows_finish(rows.t(), base=base, out=out, places=PLACES)
    with pytest.raises(TypeError, match="dtype"):
        sum_rows_finish(rows.long(), base=base, out=out, places=PLACES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_gives_the_reference_bits(dtype):
    places = ((3, 5000), (6000, 17), (7000, 100_000))
    n = sum(k for _, k in places)
    rows, base = _inputs(7, dtype, device="cuda", n=n, pad=13)
    ref = _run(rows, base, dtype, places, 8, "reference")
    tri = _run(rows, base, dtype, places, 8, "triton")
    assert torch.equal(ref.view(torch.int8), tri.view(torch.int8))
