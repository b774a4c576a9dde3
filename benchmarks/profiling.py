"""What the step benchmarks share: how a step is synchronised for timing, and one profiled
training step's summary (``--profile DIR``)."""

from __future__ import annotations

import gzip
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    """Wait for everything queued on ``device`` (every stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_sync(device: torch.device) -> None:
    """Wait for the compute stream only: a staleness-1 step ends there, its reduction runs on
    into the next step (a full sync would wait for it, untimed)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# NVML's clock-event bits that mean the power limit held the SM clock down: the software power
# cap and the hardware power brake (nvml.h, nvmlClocksEventReason*)
_POWER_CAPPED = 0x4 | 0x80
_NO_NVML: list[Exception] = []  # (why NVML failed, once a process has said it)


class Clocks:
    """The SM clock, the board's power draw and how often the power limit held the clock down,
    sampled every ``every_s`` by a thread while the ``with`` block runs (NVML; no CUDA work).

    A GPU at its power limit lowers its clock: device work added beside the matmuls (codecs,
    NCCL kernels spinning for a peer) then slows the matmuls themselves, though it overlaps
    them. ``summary`` is None off CUDA or without NVML (``nvidia-ml-py``)."""

    def __init__(self, device: torch.device, every_s: float = 0.02):
        self.device, self.every_s = device, every_s
        self.samples: list[tuple[int, float, int]] = []
        self.joules: float | None = None  # the board's energy over the block (NVML's counter)
        self._mj0 = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
                self._nvml = pynvml
            except Exception as e:  # noqa: BLE001 (no NVML: no clock figures, said once)
                if not _NO_NVML:
                    _NO_NVML.append(e)
                    print(f"  (no SM clock figures: NVML unavailable: {e!r})", flush=True)

    def _sample(self) -> None:
        nvml, h = self._nvml, self._handle
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # (older NVML)
        while not self._stop.is_set():
            mhz = nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)
            watts = nvml.nvmlDeviceGetPowerUsage(h) / 1e3
            self.samples.append((mhz, watts, reasons(h)))
            self._stop.wait(self.every_s)

    def __enter__(self) -> Clocks:
        if self._handle is not None:
            self._mj0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._mj0
            self.joules = mj / 1e3

    @property
    def summary(self) -> dict | None:
        """Mean SM MHz, mean watts, the share of samples power-capped, the joules over the block
        (when NVML counts energy); None without samples."""
        if not self.samples:
            return None
        n = len(self.samples)
        return {
            "joules": round(self.joules, 1) if self.joules is not None else None,
            "sm_mhz": round(sum(s[0] for s in self.samples) / n),
            "power_w": round(sum(s[1] for s in self.samples) / n),
            "power_capped": round(sum(bool(s[2] & _POWER_CAPPED) for s in self.samples) / n, 2),
            "samples": n,
        }


def host_and_device(fn: Callable[[], object], calls: int, rounds: int) -> dict:
    """``fn`` (CUDA work) issued ``calls`` times back to back, no synchronisation, in each of
    ``rounds`` rounds after 3 warm-up calls: the medians of the host's microseconds a call (what
    issuing it costs) and of the device's milliseconds a call (CUDA events around the round)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, device = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / calls)
    return {"host_us": round(statistics.median(host), 1), "device_ms": statistics.median(device)}


def profiler(device: torch.device, *, device_only: bool = False):
    """torch's profiler over the host's ops and, on CUDA, the device's kernels; ``device_only``
    (CUDA): the kernels and the CUDA runtime's calls alone, at a fraction of the host cost."""
    acts = [] if device_only and device.type == "cuda" else [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


class _HostProfile:
    """cProfile over several steps: ``enable`` / ``disable`` around each, stats accumulate."""

    def __init__(self) -> None:
        import cProfile

        self.prof = cProfile.Profile()
        self.steps = 0

    def enable(self) -> None:
        self.prof.enable()

    def disable(self) -> None:
        self.prof.disable()
        self.steps += 1


_HOST: dict[str, _HostProfile] = {}


def host_profiler() -> _HostProfile:
    """The current variant's host profiler (one per process and variant run; a new one after
    :func:`write_host_profile`)."""
    return _HOST.setdefault("current", _HostProfile())


def write_host_profile(host: _HostProfile, path: Path) -> None:
    """The Python functions the host spent its steps in, by own time and by total time, per
    step (ms), and which of it is qsdp's (``/qsdp/`` in the file name)."""
    import io
    import pstats

    _HOST.pop("current", None)
    path = path.with_name(path.name.replace("+", "_"))
    path.parent.mkdir(parents=True, exist_ok=True)
    stats = pstats.Stats(host.prof)
    per = 1e3 / max(host.steps, 1)
    total = sum(v[2] for v in stats.stats.values()) * per  # (own time of every function)
    ours = sum(v[2] for k, v in stats.stats.items() if "/qsdp/" in k[0]) * per
    out = io.StringIO()
    out.write(
        f"{host.steps} steps; host Python+native time per step {total:.1f} ms, "
        f"of it in qsdp's own functions {ours:.1f} ms\n\n"
    )
    for key in ("tottime", "cumulative"):
        stats.stream = out
        stats.sort_stats(key).print_stats(45)
    path.write_text(out.getvalue())


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
"""The runtime and driver calls that start a kernel (Triton's launcher calls the driver's)."""


def counts(prof) -> dict:
    """What the host did in a profiled step, and the device's kernel time: qsdp's hook calls and
    their host time (scopes ``qsdp::...``), FSDP2's scopes' host time, kernel launches,
    allocations (``aten::empty*``), copies (``cudaMemcpyAsync``), views, every ``aten::`` op,
    and the kernels' summed durations (ms, over all streams: overlapping streams add up), NCCL's
    apart (:func:`_kernel_ms`).
    The host's own time per step is measured without the profiler (``cpu_s_per_step``)."""
    ka = prof.key_averages()

    def n(*names: str) -> int:
        return sum(e.count for e in ka if e.key in names)

    kernel_ms, nccl_ms = _kernel_ms(ka)
    # (a record_function scope has a host record and, under CUDA, a device one of the same name)
    ours = [e for e in ka if e.key.startswith("qsdp::") and _on_host(e)]
    fsdp = [e for e in ka if e.key.startswith("FSDP::") and _on_host(e)]
    return {
        "qsdp_hook_calls": sum(e.count for e in ours),
        # (inclusive host time of qsdp's hook scopes; FSDP2's scopes hold qsdp's all-gathers)
        "qsdp_hook_host_ms": round(sum(e.cpu_time_total for e in ours) / 1e3, 2),
        "fsdp_scopes_host_ms": round(sum(e.cpu_time_total for e in fsdp) / 1e3, 2),
        "launches": n(*LAUNCHES),
        "aten_ops": sum(e.count for e in ka if e.key.startswith("aten::")),
        "allocations": sum(e.count for e in ka if e.key.startswith("aten::empty")),
        "memcpy": n("cudaMemcpyAsync"),
        "views": n("aten::view", "aten::as_strided", "aten::slice", "aten::select"),
        "kernel_ms": kernel_ms,
        "nccl_kernel_ms": nccl_ms,
    }


def _kernel_ms(events) -> tuple[float, float]:
    """The device time of the kernels that compute, and of NCCL's (ms, summed over streams).
    Apart, because an NCCL kernel runs from its launch until its last peer arrived: its time is
    mostly waiting, and summed with the others it moved with every change that moved the
    waits (issue 32's traces, 2026-11-27)."""
    compute = nccl = 0.0
    for e in events:
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        us = getattr(e, "self_device_time_total", 0.0)
        if e.key.startswith("nccl:"):  # the collective's annotation: its kernel's time again
            continue
        if e.key.startswith(("ncclDevKernel", "ncclKernel")):
            nccl += us
        else:
            compute += us
    return round(compute / 1e3, 2), round(nccl / 1e3, 2)


def _on_host(event) -> bool:
    return str(getattr(event, "device_type", "CPU")).endswith("CPU")


def scope_ops(prof) -> str:
    """Per kind of qsdp hook (``qsdp::reduce-scatter``, ...): calls, host time per call, and the
    ops it issues directly per call (its top-level ``aten::`` / ``c10d::`` calls) and the
    kernel launches under it: where a hook's host time goes."""
    kinds: dict[str, list] = {}
    for e in prof.events():
        if e.name.startswith("qsdp::") and _on_host(e):
            kinds.setdefault(e.name.split(" (")[0], []).append(e)
    lines = []
    for kind, calls in sorted(kinds.items()):
        ops: dict[str, int] = {}
        launches = 0
        stack = [c for e in calls for c in e.cpu_children]
        for child in (c for e in calls for c in e.cpu_children):
            ops[child.name] = ops.get(child.name, 0) + 1
        while stack:
            e = stack.pop()
            launches += e.name in LAUNCHES
            stack.extend(e.cpu_children)
        n = len(calls)
        host = sum(e.cpu_time_total for e in calls) / n / 1e3
        top = sorted(ops.items(), key=lambda kv: -kv[1])
        lines.append(
            f"{kind}: {n} calls, {host:.2f} ms host, {sum(ops.values()) / n:.0f} ops and "
            f"{launches / n:.0f} launches per call: "
            + ", ".join(f"{k} {v / n:.1f}" for k, v in top[:30])
        )
    return "\n".join(lines)


def write_profile(prof, path: Path, elapsed: float, memory: str = "") -> None:
    """Rank 0's profile of one step: the top ops by host time and by device time in ``path``,
    and the whole timeline (Chrome trace, for chrome://tracing or Perfetto) in
    ``path`` + ``.trace.json.gz``. A ``+`` in the file name (variant names: ``sdp4bit+s1``)
    is written ``_``: some copy tools refuse it (the GPU lender's did, 2026-11-27)."""
    path = path.with_name(path.name.replace("+", "_"))
    path.parent.mkdir(parents=True, exist_ok=True)
    ka = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else None
    parts = [f"step wall {elapsed * 1e3:.1f} ms (profiled, includes profiler overhead)", memory]
    parts.append(scope_ops(prof))
    parts.append(ka.table(sort_by="self_cpu_time_total", row_limit=40))
    if dev_key is not None:
        parts.append(ka.table(sort_by=dev_key, row_limit=40))
    path.write_text("\n\n".join(parts))
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as src, gzip.open(f"{path}.trace.json.gz", "wb") as dst:
            dst.write(src.read())
    finally:
        os.unlink(tmp)
