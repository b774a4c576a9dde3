"""benchmarks/profiling.py: a profiled step's counts and the per-hook breakdown, on a CPU
profile whose scopes and ops are known."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .bench_scripts import load


def test_counts_and_scope_ops_name_each_hooks_ops():
    profiling = load("profiling")
    x = torch.ones(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # three calls of one hook kind, two modules
            for module in ("blocks.0", "blocks.1"):
                with torch.profiler.record_function(f"qsdp::reduce-scatter ({module})"):
                    y = torch.empty(8)
                    y.copy_(x)
                    y.add_(1)
        with torch.profiler.record_function("FSDP::post_backward_reduce (blocks.0)"):
            torch.zeros(2)
    counts = profiling.counts(prof)
    assert counts["qsdp_hook_calls"] == 6
    assert counts["qsdp_hook_host_ms"] > 0 and counts["fsdp_scopes_host_ms"] > 0
    assert counts["launches"] == 0 and counts["memcpy"] == 0  # (no CUDA here)
    assert counts["allocations"] >= 6 + 1  # the hooks' empty, FSDP's zeros
    text = profiling.scope_ops(prof)
    assert text.startswith("qsdp::reduce-scatter: 6 calls")
    assert "3 ops and 0 launches per call" in text
    assert "aten::empty 1.0" in text and "aten::copy_ 1.0" in text and "aten::add_ 1.0" in text


def test_nccl_kernels_are_counted_apart_from_the_compute():
    profiling = load("profiling")

    def event(key, device, us):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us)

    events = [
        event("ncclDevKernel_AllGather_RING_LL(...)", "DeviceType.CUDA", 4000.0),
        event("ncclDevKernel_SendRecv(...)", "DeviceType.CUDA", 1000.0),
        event("nccl:all_to_all", "DeviceType.CUDA", 1000.0),  # (the same kernel's annotation)
        event("decode_kernel", "DeviceType.CUDA", 1500.0),
        event("aten::mm", "DeviceType.CUDA", 2500.0),
        event("aten::mm", "DeviceType.CPU", 9000.0),  # a host record: not a kernel
    ]
    assert profiling._kernel_ms(events) == (4.0, 5.0)
