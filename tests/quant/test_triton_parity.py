"""The fused Triton kernels against the torch reference, bit for bit.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest); the
``gpu`` tests repeat the comparison on CUDA where the kernels are compiled.
"""

import dataclasses
import itertools

import pytest
import torch

from qsdp.quant import (
    Encoded,
    QuantSpec,
    decode,
    decode_add,
    decode_rows,
    decode_sum,
    decode_sum_encode,
    decode_sum_finish,
    encode,
    encode_diff,
    encode_rows,
)

from .helpers import ODD_SIZES, heavy_tailed

CASES = [
    # bits, group, scheme, rounding, hadamard block, sign seed, scale dtype
    (bits, scheme, rounding)
    for bits, scheme, rounding in itertools.product(
        (2, 3, 4, 6, 8), ("absmax", "minmax", "shift-lattice"), ("nearest", "stochastic")
    )
]
HADAMARD = [(None, None), (16, None), (32, 7)]


def _spec(bits, scheme, rounding, had=(None, None), group=64, **kw):
    return QuantSpec(
        bits, group, scheme, rounding, hadamard_block=had[0], hadamard_seed=had[1], **kw
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    assert bool(same.all()), f"{int((~same).sum())} of {a.numel()} differ"


def _parity(spec, x, device="cpu", **kw):
    x = x.to(device)
    a = encode(x, spec, backend="reference", **kw)
    b = encode(x, spec, backend="triton", **kw)
    _same(a.payload, b.payload)
    _same(decode(a, backend="reference"), decode(a, backend="triton"))
    return a


@pytest.mark.parametrize(("bits", "scheme", "rounding"), CASES)
@pytest.mark.parametrize("had", HADAMARD, ids=["plain", "h16", "h32-signs"])
def test_encode_decode_bit_exact(bits, scheme, rounding, had):
    spec = _spec(bits, scheme, rounding, had)
    for n in ODD_SIZES:
        _parity(spec, heavy_tailed(n, seed=n), seed=2**40 + 3, step=7, stream=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["absmax", "minmax"])
def test_half_inputs_bit_exact(dtype, scheme):
    _parity(_spec(4, scheme, "stochastic", (32, 1)), heavy_tailed(3000, seed=1, dtype=dtype))


@pytest.mark.parametrize("group", [16, 2048, 8192])
def test_group_sizes(group):
    spec = QuantSpec(4, group, "absmax", "stochastic", hadamard_block=16)
    _parity(spec, heavy_tailed(3 * group + 5, seed=group))


@pytest.mark.parametrize("had", [(None, None), (32, 1)], ids=["plain", "h32"])
def test_whole_tiles_without_tail(had):
    # 2 x 4096 elements fill the main grid exactly: no masked tail program runs
    spec = _spec(4, "minmax", "stochastic", had)
    _parity(spec, heavy_tailed(2 * 4096, seed=6))


def test_bf16_scales_bit_exact():
    spec = _spec(4, "absmax", "nearest", (32, None), scale_dtype=torch.bfloat16)
    _parity(spec, heavy_tailed(2000, seed=9))


def test_nonfinite_propagate_bit_exact():
    spec = _spec(8, "minmax", "nearest", nonfinite="propagate")
    x = heavy_tailed(1000, seed=4)
    x[[5, 700]] = float("nan")
    x[900] = float("inf")
    _parity(spec, x)


@pytest.mark.parametrize(("bits", "out_bits"), [(8, 4), (6, 3), (3, 6)])
def test_multi_chunk_kernels_bit_exact(bits, out_bits):
    _multi_chunk(bits, out_bits)


def _multi_chunk(bits: int, out_bits: int) -> None:
    spec = _spec(bits, "absmax", "stochastic", (32, 5))
    n = 1000
    encs = [encode(heavy_tailed(n, seed=s), spec, stream=s, backend="reference") for s in range(3)]
    stacked = torch.stack([e.payload for e in encs])
    _same(
        decode_sum(stacked, n, spec, backend="reference"),
        decode_sum(stacked, n, spec, backend="triton"),
    )
    own = torch.randn(n)
    a, b = own.clone(), own.clone()
    decode_sum(stacked, n, spec, out=a, accumulate=True, backend="reference")
    decode_sum(stacked, n, spec, out=b, accumulate=True, backend="triton")
    _same(a, b)
    out_spec = _spec(out_bits, "absmax", "stochastic", (32, 5))
    r = decode_sum_encode(stacked, n, spec, out_spec, seed=3, step=1, stream=2, backend="reference")
    t = decode_sum_encode(stacked, n, spec, out_spec, seed=3, step=1, stream=2, backend="triton")
    _same(r.payload, t.payload)
    buf = torch.zeros(1 + out_spec.payload_bytes(n), dtype=torch.uint8)  # unaligned out=
    decode_sum_encode(
        stacked, n, spec, out_spec, seed=3, step=1, stream=2, out=buf[1:], backend="triton"
    )
    _same(buf[1:], r.payload)


@pytest.mark.parametrize("scheme", ["absmax", "minmax"])
def test_weight_difference_kernels_bit_exact(scheme):
    spec = QuantSpec(4, 2048, scheme, "stochastic")
    base = heavy_tailed(5000, seed=1, dtype=torch.bfloat16)
    new = (base.float() + 1e-3 * torch.randn(5000)).to(torch.bfloat16)
    a = encode_diff(new, base, spec, seed=4, backend="reference")
    b = encode_diff(new, base, spec, seed=4, backend="triton")
    _same(a.payload, b.payload)
    ta, tb = base.clone(), base.clone()
    decode_add(a, ta, backend="reference")
    decode_add(a, tb, backend="triton")
    _same(ta, tb)


def test_encode_into_unaligned_slice():
    spec = _spec(4, "minmax", "stochastic")
    x = heavy_tailed(333, seed=3)
    nbytes = spec.payload_bytes(333)
    buf = torch.zeros(3 + nbytes, dtype=torch.uint8)
    encode(x, spec, out=buf[3:], backend="triton")
    _same(buf[3:], encode(x, spec, backend="reference").payload)
    assert int(buf[:3].sum()) == 0  # nothing written outside the slice


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4, 6])
def test_decode_unaligned_rows(scale_dtype, bits):
    # all-to-all chunks sit at any byte offset: the kernels then read scales byte by byte
    spec = _spec(bits, "absmax", "stochastic", (16, None), scale_dtype=scale_dtype)
    n = 333
    nbytes = spec.payload_bytes(n)
    buf = torch.zeros(1 + 3 * nbytes, dtype=torch.uint8)
    rows = buf[1:].view(3, nbytes)
    for i in range(3):
        encode(heavy_tailed(n, seed=i), spec, stream=i, out=rows[i], backend="triton")
        _same(rows[i], encode(heavy_tailed(n, seed=i), spec, stream=i, backend="reference").payload)
    _same(
        decode_sum(rows, n, spec, backend="reference"), decode_sum(rows, n, spec, backend="triton")
    )


def test_int64_offset_path(monkeypatch):
    # Tensors of 2^31 elements do not fit CI; force the int64 indexing on small ones.
    from qsdp.quant._triton import launch

    monkeypatch.setattr(launch, "_big", lambda *sizes: True)
    _parity(_spec(4, "minmax", "stochastic", (32, 3)), heavy_tailed(3000, seed=2))
    _parity(_spec(3, "minmax", "stochastic", (32, 3)), heavy_tailed(3000, seed=2))
    _multi_chunk(8, 4)
    _multi_chunk(6, 3)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "scheme", "rounding"), CASES)
@pytest.mark.parametrize("had", HADAMARD, ids=["plain", "h16", "h32-signs"])
def test_gpu_kernels_match_reference(bits, scheme, rounding, had):
    spec = _spec(bits, scheme, rounding, had, group=128)
    for n in (*ODD_SIZES, 1 << 20):
        x = heavy_tailed(n, seed=n, dtype=torch.bfloat16)
        _parity(spec, x, device="cuda", seed=11, step=3, stream=1)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "out_bits"), [(8, 4), (6, 3)])
def test_gpu_multi_chunk_and_difference_kernels(bits, out_bits):
    spec = _spec(bits, "absmax", "stochastic", (32, None), group=128)
    out_spec = _spec(out_bits, "absmax", "stochastic", (32, None), group=128)
    n = (1 << 20) + 3
    xs = [heavy_tailed(n, seed=s).cuda() for s in range(4)]
    stacked = torch.stack([encode(x, spec, stream=i).payload for i, x in enumerate(xs)])
    _same(
        decode_sum(stacked, n, spec, backend="reference"),
        decode_sum(stacked, n, spec, backend="triton"),
    )
    r = decode_sum_encode(stacked, n, spec, out_spec, stream=2, backend="reference")
    t = decode_sum_encode(stacked, n, spec, out_spec, stream=2, backend="triton")
    _same(r.payload, t.payload)
    base = xs[0].to(torch.bfloat16)
    new = xs[1].to(torch.bfloat16)
    a = encode_diff(new, base, out_spec, backend="reference")
    _same(a.payload, encode_diff(new, base, out_spec, backend="triton").payload)
    ta, tb = base.clone(), base.clone()
    decode_add(a, ta, backend="reference")
    decode_add(a, tb, backend="triton")
    _same(ta, tb)


@pytest.mark.parametrize("had", HADAMARD, ids=["plain", "h16", "h32-signs"])
@pytest.mark.parametrize("n", [1, 333, 4096 + 13])
def test_decode_rows_bit_exact(had, n):
    spec = _spec(4, "minmax", "stochastic", had)
    nbytes = spec.payload_bytes(n)
    buf = torch.zeros(1 + 3 * nbytes, dtype=torch.uint8)  # rows at odd byte offsets
    rows = buf[1:].view(3, nbytes)
    for i in range(3):
        encode(heavy_tailed(n, seed=i), spec, stream=i, out=rows[i], backend="reference")
    ref = decode_rows(rows, n, spec, backend="reference")
    tri = torch.full((3, n), float("nan"), dtype=torch.bfloat16)
    decode_rows(rows, n, spec, out=tri, backend="triton")
    _same(ref.to(torch.bfloat16), tri)
    for i in range(3):  # each row is the plain decode of its payload
        _same(ref[i], decode_sum(rows[i : i + 1], n, spec, backend="reference"))


@pytest.mark.parametrize("n", [333, 4096 + 13])
def test_decode_rows_strided_payload_rows(n):
    # the FSDP policy-split gather: [codes | pad | raw bytes | pad] per rank, rows 16-aligned
    spec = _spec(8, "absmax", "nearest")
    nbytes = spec.payload_bytes(n)
    row = -(-nbytes // 16) * 16 + 48
    rows = torch.zeros(3, row, dtype=torch.uint8)[:, :nbytes]
    for i in range(3):
        encode(heavy_tailed(n, seed=i), spec, stream=i, out=rows[i], backend="reference")
    ref = decode_rows(rows.contiguous(), n, spec, backend="reference")
    tri = torch.full((3, n), float("nan"))
    decode_rows(rows, n, spec, out=tri, backend="triton")
    _same(ref, tri)


def test_decode_rows_checks_out():
    spec = _spec(8, "absmax", "nearest")
    rows = torch.stack([encode(torch.randn(100), spec).payload for _ in range(2)])
    with pytest.raises(ValueError, match=r"out must be \[2, 100\]"):
        decode_rows(rows, 100, spec, out=torch.empty(2, 99))


def _rows_case(spec, n, k, skip, *, dtype=torch.float32, row_bytes=None):
    """``k`` rows of ``n`` elements (strided: a wider buffer's columns), every row but ``skip``
    encoded by ``encode_rows`` into a strided, odd-offset ``out`` on both backends."""
    xs = torch.stack([heavy_tailed(n, seed=10 + i) for i in range(k)])
    wide = torch.zeros(k, n + 5, dtype=dtype)
    wide[:, 2 : 2 + n] = xs.to(dtype)
    rows = wide[:, 2 : 2 + n]
    slots = k - (skip is not None)
    nbytes = spec.payload_bytes(n)
    row_bytes = row_bytes or nbytes
    streams = [1000 + 7 * s for s in range(slots)]
    outs = {}
    for backend in ("reference", "triton"):
        buf = torch.full((1 + slots * row_bytes,), 0xAB, dtype=torch.uint8)
        out = buf[1:].view(slots, row_bytes) if slots else buf[:0].view(0, row_bytes)
        encode_rows(
            rows, spec, out=out, streams=streams, skip=skip, seed=5, step=9, backend=backend
        )
        outs[backend] = out
        assert bool((buf[0] == 0xAB).all()) and bool((out[:, nbytes:] == 0xAB).all())
    _same(outs["reference"], outs["triton"])
    peers = [j for j in range(k) if j != skip]
    for s, j in enumerate(peers):  # each row: exactly encode() of its source row
        one = encode(rows[j], spec, seed=5, step=9, stream=streams[s], backend="reference")
        _same(outs["triton"][s, :nbytes], one.payload)


@pytest.mark.parametrize("had", HADAMARD, ids=["plain", "h16", "h32-signs"])
@pytest.mark.parametrize(("k", "skip"), [(4, 0), (4, 2), (3, 2), (1, 0), (3, None)])
def test_encode_rows_one_launch_matches_encode_per_row(had, k, skip):
    spec = _spec(4, "minmax", "stochastic", had).propagating()
    _rows_case(spec, 4096 + 13, k, skip)
    _rows_case(spec, 333, k, skip, dtype=torch.bfloat16, row_bytes=spec.payload_bytes(333) + 19)


@pytest.mark.parametrize("scheme", ["minmax", "shift-lattice"])
def test_encode_rows_reads_a_step_from_device_memory_as_the_argument(scheme):
    """The kernel that reads its step from memory (what a CUDA graph replays) writes the
    argument's bytes, and another step's noise when the memory changes (on CPU: the kernel in
    Triton's interpreter)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = _spec(4, scheme, "stochastic", (16, None)).propagating()
    rows = torch.stack([heavy_tailed(1000, seed=20 + i) for i in range(3)]).to(dev)
    kw = dict(streams=[3, 4], skip=1, seed=5, backend="triton")
    out = {}
    for key, step in [("int9", 9), ("mem9", torch.tensor([9], device=dev)), ("int10", 10)]:
        out[key] = torch.empty(2, spec.payload_bytes(1000), dtype=torch.uint8, device=dev)
        encode_rows(rows, spec, out=out[key], step=step, **kw)
    _same(out["int9"], out["mem9"])
    assert bool((out["int9"] != out["int10"]).any())
    step = torch.tensor([9], device=dev)
    step.fill_(10)
    mem = torch.empty_like(out["int10"])
    encode_rows(rows, spec, out=mem, step=step, **kw)
    _same(mem, out["int10"])
    with pytest.raises(ValueError, match="one int64"):
        encode_rows(rows, spec, out=mem, step=torch.tensor([9.0], device=dev), **kw)
    with pytest.raises(ValueError, match="pass the step as an int"):
        encode_rows(rows, spec, out=mem, step=step, **{**kw, "backend": "reference"})


@pytest.mark.parametrize("diff", [False, True], ids=["encode", "encode_diff"])
def test_encode_reads_a_step_from_device_memory_as_the_argument(diff):
    """``encode`` and ``encode_diff`` (SDP4Bit's weight differences, what a replayed gather
    launches) with the step in memory: the argument's bytes, another step's when it changes."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = _spec(4, "absmax", "stochastic", (None, None), group=64).propagating()
    x = heavy_tailed(1000 + 7, seed=31).to(dev, torch.bfloat16)
    base = heavy_tailed(1000 + 7, seed=32).to(dev, torch.bfloat16)

    def run(step, **over):
        kw = dict(seed=5, step=step, stream=6, backend="triton") | over
        return (encode_diff(x, base, spec, **kw) if diff else encode(x, spec, **kw)).payload

    step = torch.tensor([9], device=dev)
    _same(run(step), run(9))
    step.fill_(10)
    _same(run(step), run(10))
    assert bool((run(9) != run(10)).any())
    with pytest.raises(ValueError, match="one int64"):
        run(torch.tensor([9], device=dev, dtype=torch.int32))
    with pytest.raises(ValueError, match="pass the step as an int"):
        run(step, backend="reference")
    with pytest.raises(ValueError, match="pass the step as an int"):  # (raise: not the kernel's)
        kw = dict(seed=5, step=step, stream=6, backend="triton")
        plain = dataclasses.replace(spec, nonfinite="raise")
        encode_diff(x, base, plain, **kw) if diff else encode(x, plain, **kw)


def test_decode_sum_encode_reads_a_step_from_device_memory_as_the_argument():
    """The middle hop of a replayed two-level reduce-scatter: with the step in memory the
    argument's bytes, another step's when it changes; refused off the Triton kernel."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    in_spec = _spec(8, "absmax", "stochastic", (32, 7), group=128).propagating()
    out_spec = _spec(4, "absmax", "stochastic", (32, 7), group=128).propagating()
    n = 1000 + 7
    stacked = torch.stack([encode(heavy_tailed(n, seed=40 + r).to(dev), in_spec).payload
                           for r in range(3)])  # fmt: skip

    def run(step, backend="triton"):
        kw = dict(seed=5, step=step, stream=6, backend=backend)
        return decode_sum_encode(stacked, n, in_spec, out_spec, **kw).payload

    step = torch.tensor([9], device=dev)
    _same(run(step), run(9))
    _same(run(9), run(9, backend="reference"))
    step.fill_(10)
    _same(run(step), run(10))
    assert bool((run(9) != run(10)).any())
    with pytest.raises(ValueError, match="pass the step as an int"):
        run(step, backend="reference")
    with pytest.raises(ValueError, match="one int64"):
        run(torch.tensor([9], device=dev, dtype=torch.int32))


def test_encode_rows_checks_its_arguments():
    spec = _spec(8, "absmax", "nearest")
    rows = torch.randn(3, 100)
    out = torch.empty(2, spec.payload_bytes(100), dtype=torch.uint8)
    with pytest.raises(ValueError, match="one stream per row of out"):
        encode_rows(rows, spec, out=out, streams=[1], skip=1)
    with pytest.raises(ValueError, match=r"out uint8 \[2, >= "):
        encode_rows(rows, spec, out=out[:, 1:], streams=[1, 2], skip=1)
    with pytest.raises(ValueError, match="skip=3"):
        encode_rows(rows, spec, out=out, streams=[1, 2], skip=3)
    with pytest.raises(ValueError, match="unit column stride"):
        encode_rows(torch.randn(100, 3).t(), spec, out=out, streams=[1, 2], skip=0)
    bad = rows.clone()
    bad[2, 7] = float("nan")  # nonfinite="raise": the row that holds it raises, as encode()
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_rows(bad, spec, out=out, streams=[1, 2], skip=0, backend="triton")


@pytest.mark.gpu
def test_gpu_encode_rows_matches_encode_per_row():
    spec = _spec(4, "absmax", "stochastic", (32, None), group=128).propagating()
    n = (1 << 20) + 3
    rows = torch.stack([heavy_tailed(n, seed=s) for s in range(4)]).to(torch.bfloat16).cuda()
    nbytes = spec.payload_bytes(n)
    out = torch.zeros(3, nbytes + 16, dtype=torch.uint8, device="cuda")
    encode_rows(rows, spec, out=out, streams=[5, 6, 7], skip=1, seed=3, step=2, backend="triton")
    for s, j in enumerate((0, 2, 3)):
        one = encode(rows[j], spec, seed=3, step=2, stream=5 + s, backend="reference")
        _same(out[s, :nbytes], one.payload)


@pytest.mark.parametrize("had", HADAMARD, ids=["plain", "h16", "h32-signs"])
@pytest.mark.parametrize("n", [333, 3 * 4096 + 13])  # (the longer: a tile inside one run)
def test_decode_sum_finish_one_launch_matches_the_steps(had, n):
    """Own chunk + the decoded peers, divided by 3, cast to bf16 and scattered to runs of a
    longer output (gaps between them kept), equals the reference's float32 copy, decode_sum
    onto it, IEEE division by a device scalar, cast and copy; in order too; both backends."""
    spec = _spec(4, "minmax", "stochastic", had)
    rows = torch.stack([encode(heavy_tailed(n, seed=i), spec, stream=i).payload for i in range(3)])
    base = heavy_tailed(n, seed=9).to(torch.bfloat16)
    cut = [0, 5, n // 3, n - 1, n]  # runs of 5, ~n/3 - 5, the rest but one, 1
    runs = tuple((s + 7 * i, e - s) for i, (s, e) in enumerate(zip(cut, cut[1:], strict=False)))
    size = runs[-1][0] + runs[-1][1] + 4
    acc = base.to(torch.float32, copy=True)
    decode_sum(rows, n, spec, out=acc, accumulate=True, backend="reference")
    want = (acc / torch.tensor(3.0)).to(torch.bfloat16)
    for backend in ("reference", "triton"):
        out = torch.full((size,), -1.0, dtype=torch.bfloat16)
        decode_sum_finish(rows, n, spec, base=base, out=out, divisor=3, runs=runs, backend=backend)
        got = torch.cat([out[s : s + k] for s, k in runs])
        _same(got, want)
        kept = torch.ones(size, dtype=torch.bool)
        for s, k in runs:
            kept[s : s + k] = False
        assert bool((out[kept] == -1.0).all()), backend  # nothing outside the runs written
        flat = torch.empty(n, dtype=torch.float32)
        decode_sum_finish(rows, n, spec, base=base, out=flat, backend=backend)
        _same(flat, acc)


def test_decode_sum_finish_checks_its_arguments():
    spec = _spec(8, "absmax", "nearest")
    rows = torch.stack([encode(torch.randn(10), spec).payload for _ in range(2)])
    base = torch.randn(10)
    with pytest.raises(ValueError, match="covering 10 elements"):
        decode_sum_finish(rows, 10, spec, base=base, out=torch.empty(20), runs=((0, 4), (9, 5)))
    with pytest.raises(ValueError, match="inside out"):
        decode_sum_finish(rows, 10, spec, base=base, out=torch.empty(12), runs=((0, 4), (9, 6)))
    with pytest.raises(ValueError, match="base must be 10 elements"):
        decode_sum_finish(rows, 10, spec, base=torch.randn(11), out=torch.empty(10))


@pytest.mark.gpu
def test_gpu_decode_sum_finish_matches_reference():
    spec = _spec(8, "absmax", "stochastic", (32, None), group=128)
    n = (1 << 20) + 3
    rows = torch.stack(
        [encode(heavy_tailed(n, seed=s).cuda(), spec, stream=s).payload for s in range(3)]
    )
    base = heavy_tailed(n, seed=7).to(torch.bfloat16).cuda()
    runs = ((0, 1000), (1010, n - 1001), (n + 20, 1))
    outs = []
    for backend in ("reference", "triton"):
        out = torch.zeros(n + 30, dtype=torch.bfloat16, device="cuda")
        decode_sum_finish(rows, n, spec, base=base, out=out, divisor=3, runs=runs, backend=backend)
        outs.append(out)
    _same(outs[0], outs[1])


def _add_rows_case(n: int, device: str):
    """Three 4-bit difference payloads (Hadamard, stochastic) and bf16 targets at odd values."""
    spec = _spec(4, "absmax", "stochastic", (32, 7), group=128)
    rows = torch.stack(
        [encode(heavy_tailed(n, seed=s).to(device), spec, stream=s).payload for s in range(3)]
    )
    target = torch.stack([heavy_tailed(n, seed=20 + s) for s in range(3)]).to(torch.bfloat16)
    return spec, rows, target.to(device)


@pytest.mark.parametrize("n", [1, 333, 4096 + 13])
def test_decode_rows_accumulate_is_decode_add_per_row(n):
    """The weight-difference all-gather's receive side in one launch: each row of ``out`` gets
    its payload added, the bits of ``decode_add`` on that row, on both backends."""
    spec, rows, target = _add_rows_case(n, "cpu")
    expect = target.clone()
    for j in range(3):
        enc = Encoded(payload=rows[j], numel=n, dtype=torch.bfloat16, spec=spec)
        decode_add(enc, expect[j], backend="reference")
    for backend in ("reference", "triton"):
        got = target.clone()
        decode_rows(rows, n, spec, out=got, accumulate=True, backend=backend)
        _same(expect, got)
    assert not torch.equal(expect, target)  # something was added
    with pytest.raises(ValueError, match="needs out="):
        decode_rows(rows, n, spec, accumulate=True)


@pytest.mark.gpu
def test_gpu_decode_rows_accumulate_matches_reference():
    n = (1 << 20) + 3
    spec, rows, target = _add_rows_case(n, "cuda")
    outs = []
    for backend in ("reference", "triton"):
        out = target.clone()
        decode_rows(rows, n, spec, out=out, accumulate=True, backend=backend)
        outs.append(out)
    _same(outs[0], outs[1])
