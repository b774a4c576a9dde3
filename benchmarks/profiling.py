"""What the step benchmarks share: how a step is synchronised for timing, and one profiled
training step's summary (``--profile DIR``)."""

from __future__ import annotations

import gzip
import os
import tempfile
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


def profiler(device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


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
