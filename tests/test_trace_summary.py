"""benchmarks/trace_summary.py: per-stream busy time, the compute stream's waits and the skew
between ranks, read from profiler traces (hand-made ones here, every figure known)."""

from __future__ import annotations

import gzip
import json

import pytest

from .bench_scripts import load


def _k(tid: int, ts: float, dur: float, name: str, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "tid": tid, "pid": 0, "ts": ts, "dur": dur, "name": name}


def _trace(gather_start: float) -> dict:
    """Compute stream 7: four kernels; it idles 1000-3000 us waiting for the all-gather on
    stream 9 (which ends at 3000), and 4000-4500 with nothing ending then (the host)."""
    events = [
        _k(7, 0, 500, "gemm_a"),
        _k(7, 500, 500, "gemm_b(args)"),
        _k(7, 3000, 1000, "gemm_a"),
        _k(7, 4500, 100, "gemm_c"),
        _k(9, gather_start, 3000 - gather_start, "ncclDevKernel_AllGather_RING_LL(x)"),
        _k(9, 5000, 10, "ncclDevKernel_AllGather_RING_LL(x)"),
        _k(11, 100, 50, "Memcpy DtoD", cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 0, "dur": 9999, "name": "aten::mm"},
    ]
    return {"traceEvents": events}


def test_streams_waits_and_skew(tmp_path):
    ts = load("trace_summary")
    paths = []
    for rank, start in ((0, 1200.0), (1, 2800.0)):  # rank 1 reaches the gather late
        path = tmp_path / f"r{rank}.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(_trace(start), f)
        paths.append(path)
    events = ts.load(paths[0])
    assert len(events) == 7  # the cpu op is not a device event
    rows = {s["stream"]: s for s in ts.streams(events)}
    assert rows[7]["busy_ms"] == 2.1 and rows[7]["kernels"] == 4
    assert rows[7]["top"][0] == ("gemm_a", 1.5)  # names cut at "(", summed
    assert rows[9]["busy_ms"] == 1.81 and (rows[9]["from_ms"], rows[9]["to_ms"]) == (1.2, 5.01)
    assert [s["stream"] for s in ts.streams(events)] == [7, 9, 11]  # busiest first
    assert ts.compute_stream(events) == 7
    total, causes = ts.waits(events)
    assert total == 2.5
    assert causes == [((9, "ncclDevKernel_AllGather_RING_LL"), 2.0, 1), (("host", ""), 0.5, 1)]
    late = ts.skew([ts.load(p) for p in paths], 9, "AllGather")
    assert late == [[1.2, 2.8], [5.0, 5.0]]  # rank 1 started the first gather 1.6 ms later


def test_nccl_timeline_and_wire_idle():
    """NCCL kernels on two streams: 0-2 ms and 1-3 ms overlap, then nothing until 4 ms, then
    4-5 ms: a 5 ms span with the wire idle for 1 ms; other kernels do not count."""
    ts = load("trace_summary")
    events = [
        _k(7, 0, 9000, "gemm_a"),
        _k(19, 0, 2000, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"),
        _k(21, 1000, 2000, "ncclDevKernel_AllReduce_Sum_u8_RING_LL(x)"),
        _k(21, 4000, 1000, "ncclDevKernel_AllReduce_Sum_u8_RING_LL(x)"),
    ]
    assert ts.wire_idle(events) == (5.0, 1.0)
    assert ts.wire_idle(events, "Sum_u8") == (4.0, 1.0)  # 1-3 and 4-5 ms
    assert ts.nccl_timeline(events) == [
        (19, 0.0, 2.0, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
        (21, 1.0, 2.0, "ncclDevKernel_AllReduce_Sum_u8_RING_LL"),
        (21, 4.0, 1.0, "ncclDevKernel_AllReduce_Sum_u8_RING_LL"),
    ]
    assert ts.wire_idle([_k(7, 0, 10, "gemm_a")]) == (0.0, 0.0)


def _c(tid: int, ts: float, dur: float, name: str, corr: int) -> dict:
    return {**_k(tid, ts, dur, name), "args": {"correlation": corr}}


def _launch(ts: float, corr: int) -> dict:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "tid": 1,
        "pid": 1,
        "ts": ts,
        "dur": 5,
        "args": {"correlation": corr},
    }


def test_lateness_charges_each_wait_to_what_held_the_last_rank(tmp_path):
    """Four collectives on stream 9 over two ranks, the last rank late for a different reason
    each time: after its own encode on stream 9 (rank 1, 400 us), its host launch (rank 0,
    300 us), a kernel on stream 7 it waited on (rank 1, 200 us), nothing (rank 0, 100 us); a
    fifth starts together (no wait)."""
    ts = load("trace_summary")
    r0 = [
        _c(9, 1000, 100, "ncclDevKernel_AllGather(x)", 1),  # waits 400 for rank 1
        _c(9, 3000, 50, "ncclDevKernel_SendRecv(x)", 2),
        _launch(2990, 2),  # last: host
        _c(9, 5000, 250, "ncclDevKernel_AllGather(x)", 3),  # waits 200 for rank 1
        _k(7, 6500, 500, "gemm_a"),  # ends at 7000, not 30 us before 7100: the SMs
        _c(9, 7100, 50, "ncclDevKernel_AllGather(x)", 4),
        _c(9, 9000, 50, "ncclDevKernel_AllGather(x)", 5),
    ]
    r1 = [
        _c(9, 1000, 400, "encode_kernel(x)", 11),
        _c(9, 1400, 100, "ncclDevKernel_AllGather(x)", 12),
        _c(9, 2700, 350, "ncclDevKernel_SendRecv(x)", 13),
        _launch(2600, 13),
        _k(7, 4800, 390, "gemm_b(y)"),  # ends at 5190: rank 1's gather waited on it
        _c(9, 5200, 50, "ncclDevKernel_AllGather(x)", 14),
        _launch(4000, 14),
        _c(9, 7000, 150, "ncclDevKernel_AllGather(x)", 15),
        _c(9, 9000, 50, "ncclDevKernel_AllGather(x)", 16),
    ]
    paths = []
    for rank, events in enumerate((r0, r1)):
        path = tmp_path / f"r{rank}.json"
        path.write_text(json.dumps({"traceEvents": events}))
        paths.append(path)
    loaded = [ts.load(p) for p in paths]
    launched = [ts.launches(p) for p in paths]
    assert launched[0] == {2: 2995} and launched[1] == {13: 2605, 14: 4005}
    total, causes = ts.lateness(loaded, launched)
    assert total == pytest.approx(1.0)
    assert [(k, n) for k, _, n in causes] == [
        (("stream", "encode_kernel"), 1),
        (("host", ""), 1),
        (("event", "stream 7 gemm_b"), 1),
        (("sms", ""), 1),
    ]
    assert [ms for _, ms, _ in causes] == pytest.approx([0.4, 0.3, 0.2, 0.1])
