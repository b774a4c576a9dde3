"""Kernel time vs. call time of the quantizer ops (torch.profiler), for tuning on one GPU.

    python benchmarks/profile_quant.py --size-mib 256

Prints, per op, the median wall time per call (CUDA events) and the GPU time of each kernel
the call launched (profiler), so host overhead and slow kernels can be told apart.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from qsdp.quant import QuantSpec, decode, decode_sum, encode


def wall_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def kernel_us(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:40]] += ev.device_time / reps
    return dict(per)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256)
    a = p.parse_args()
    numel = a.size_mib * (1 << 20) // 2
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    x32 = torch.empty(numel, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(x)
    ops = {"copy": partial(dst.copy_, x)}
    for bits in (8, 4):
        for had in (None, 32):
            spec = QuantSpec(bits, 128, "absmax", "nearest", hadamard_block=had)
            prop = QuantSpec(
                bits, 128, "absmax", "nearest", hadamard_block=had, nonfinite="propagate"
            )
            enc = encode(x, spec)
            tag = f"{bits}b h{had}"
            ops[f"encode {tag}"] = partial(encode, x, spec, out=enc.payload)
            ops[f"encode nocheck {tag}"] = partial(encode, x, prop, out=enc.payload)
            ops[f"decode bf16 {tag}"] = partial(decode, enc, out=dst)
            ops[f"decode fp32 {tag}"] = partial(decode_sum, [enc], numel, spec, out=x32)
    for name, fn in ops.items():
        ms = wall_ms(fn)
        ks = kernel_us(fn)
        kt = ", ".join(f"{k}={v:.0f}us" for k, v in ks.items())
        print(f"{name:<26} wall {ms * 1000:7.0f} us | kernels: {kt}", flush=True)


if __name__ == "__main__":
    main()
