"""Quantizer kernel throughput on one GPU, beside a device-to-device copy in the same run.

    python benchmarks/bench_quant.py --out benchmarks/results/quant_<date>/quant_<gpu>.json

For 256 MiB and 1 GiB bf16 inputs, 8/4/2 bits, with and without Hadamard (block 32), nearest
and stochastic rounding: encode and decode through the public API (``backend="triton"``), each
as bytes read + written per second and as a fraction of the copy bandwidth (a bf16
``dst.copy_(src)`` of the same size, bytes read + written). The fused multi-chunk kernels
(decode-sum of 4 chunks, decode-sum-re-encode 8 -> 4 bits) are timed at 256 MiB. Before timing,
every configuration is checked bit-exact against the torch reference on a 1 Mi-element slice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from qsdp.quant import QuantSpec, decode, decode_sum, decode_sum_encode, encode


def bench_ms(fn, reps: int, inner: int = 10) -> float:
    """Median milliseconds per call of ``fn`` by CUDA events around ``inner`` back-to-back calls.

    Back-to-back calls keep the GPU queue full as in a training step, so the figure is the
    device time per call whenever the host launches faster than the GPU executes.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def check_exact(spec: QuantSpec, x: torch.Tensor) -> None:
    s = x[: 1 << 20]
    a = encode(s, spec, seed=3, backend="reference")
    b = encode(s, spec, seed=3, backend="triton")
    if not torch.equal(a.payload, b.payload):
        raise SystemExit(f"triton encode differs from the reference for {spec}")
    if not torch.equal(decode(a, backend="reference"), decode(a, backend="triton")):
        raise SystemExit(f"triton decode differs from the reference for {spec}")


def add_row(rows, op, size_mib, spec, ms, nbytes, copy_gbs) -> None:
    gbs = nbytes / ms / 1e6
    r = {
        "op": op,
        "size_mib": size_mib,
        "bits": spec.bits if spec else None,
        "hadamard": spec.hadamard_block if spec else None,
        "rounding": spec.rounding.value if spec else None,
        "ms": round(ms, 4),
        "bytes_moved": nbytes,
        "gb_per_s": round(gbs, 1),
        "frac_of_copy": round(gbs / copy_gbs, 3) if copy_gbs else 1.0,
    }
    rows.append(r)
    print(
        f"{op:<18} {size_mib:>5} MiB  bits={r['bits']!s:>4} had={r['hadamard']!s:>4} "
        f"{r['rounding']!s:>10}  {ms:8.3f} ms  {gbs:7.0f} GB/s  "
        f"{r['frac_of_copy']:.2f} of copy",
        flush=True,
    )


def bench_size(size: int, a: argparse.Namespace, dev, rows: list[dict], fused: bool) -> None:
    numel = size * (1 << 20) // 2
    g = torch.Generator(device=dev).manual_seed(size)
    x = torch.randn(numel, device=dev, dtype=torch.bfloat16, generator=g)
    dst = torch.empty_like(x)
    copy_ms = bench_ms(partial(dst.copy_, x), a.reps)
    copy_gbs = 2 * x.nbytes / copy_ms / 1e6
    add_row(rows, "copy", size, None, copy_ms, 2 * x.nbytes, 0.0)
    for bits in a.bits:
        for had in (None, 32):
            for rounding in ("nearest", "stochastic"):
                spec = QuantSpec(bits, a.group, "absmax", rounding, hadamard_block=had)
                check_exact(spec, x)
                out = torch.empty(spec.payload_bytes(numel), dtype=torch.uint8, device=dev)
                # the kernel alone: NaN/Inf travel as NaN groups, nothing waits on the host
                free = replace(spec, nonfinite="propagate")
                ms = bench_ms(partial(encode, x, free, out=out, backend="triton"), a.reps)
                add_row(rows, "encode", size, spec, ms, x.nbytes + out.numel(), copy_gbs)
                # the default: raise on NaN/Inf, which reads the scales back (a host sync)
                ms = bench_ms(partial(encode, x, spec, out=out, backend="triton"), a.reps)
                add_row(rows, "encode+check", size, spec, ms, x.nbytes + out.numel(), copy_gbs)
                enc = encode(x, spec, out=out, backend="triton")
                ms = bench_ms(partial(decode, enc, out=dst, backend="triton"), a.reps)
                add_row(rows, "decode", size, spec, ms, x.nbytes + out.numel(), copy_gbs)
    if not fused:
        return
    k = 4
    n = numel // k
    s8 = QuantSpec(8, a.group, "absmax", "stochastic", hadamard_block=32)
    s4 = QuantSpec(4, a.group, "absmax", "stochastic", hadamard_block=32)
    stacked = torch.stack([encode(x[i * n : (i + 1) * n], s8, stream=i).payload for i in range(k)])
    acc = torch.empty(n, device=dev, dtype=torch.float32)
    ms = bench_ms(partial(decode_sum, stacked, n, s8, out=acc, backend="triton"), a.reps)
    add_row(rows, "decode_sum k=4", size, s8, ms, stacked.numel() + acc.nbytes, copy_gbs)
    ms = bench_ms(partial(decode_sum_encode, stacked, n, s8, s4, backend="triton"), a.reps)
    add_row(
        rows, "decode_sum_encode", size, s4, ms, stacked.numel() + s4.payload_bytes(n), copy_gbs
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--block", type=int, default=None, help="tuning: elements per program")
    p.add_argument("--warps", type=int, default=None, help="tuning: warps per program")
    a = p.parse_args()
    from qsdp.quant._triton import launch

    if a.block:
        launch._BLOCK = a.block
    if a.warps:
        launch._NUM_WARPS = a.warps
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant.py needs a CUDA GPU")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    rows: list[dict] = []
    for size in a.sizes_mib:
        bench_size(size, a, dev, rows, fused=size == min(a.sizes_mib))
        torch.cuda.empty_cache()

    import triton

    result = {
        "benchmark": "bench_quant",
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "group_size": a.group,
        "block": launch._BLOCK,
        "num_warps": launch._NUM_WARPS,
        "scheme": "absmax",
        "input_dtype": "bfloat16",
        "rows": rows,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
