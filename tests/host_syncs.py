"""What the GPU tests use to find ops that make the host wait for the device."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def first_sync(fn: Callable[[], object]) -> str:
    """Run ``fn`` with CUDA's sync debug mode on (it warns at every op that makes the host wait
    for the device; every rank runs to the end, so no collective is left unmatched): the first
    such warning, or ``"none"``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [
        str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)
    ]
    return syncs[0] if syncs else "none"


def host_runs_ahead(step: Callable[[], object], device: torch.device) -> bool:
    """Whether the host returns from ``step`` (a forward and backward) while the device is
    still busy with work queued before it: the device first sleeps for about a second, so a
    host that waited for anything of the step (its collectives, a flag it reads) would find the
    stream idle when ``step`` returns."""
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000_000)  # clock cycles: about a second
    step()
    ahead = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    return ahead
