"""Small constant tables the kernels read (run ends, noise streams, a divisor), put on the device
once per value and device, without a host synchronisation.

[Note: tables on the device without a sync]
``torch.tensor(values, device="cuda")`` copies from pageable host memory: the host waits for
the device queue to drain, once per new key. A key can first appear mid-training (DDP rebuilds
its buckets after the first step, a new split comes with them), and one such wait stalls the
overlap of that step (the no-host-wait GPU tests caught it). The values go through pinned
memory instead, copied asynchronously on the current stream; the caching host allocator keeps
the pinned block until the copy has run. A table is made once per (values, dtype, device) and
shared by every caller, which only reads it, and kept for the life of the process (the cache
is unbounded: a model has a few dozen tables of a few bytes each), so a kernel launch a CUDA
graph captured may read it at every replay ([Note: codec segments replayed] in
``qsdp.comm._graphs``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["on_device"]


@functools.cache
def on_device(
    values: tuple[int | float, ...] | float, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` (a tuple: 1-D; one number: 0-d) as a tensor on ``device``, made once and
    shared (never write it), with no host wait ([Note: tables on the device without a
    sync])."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
