"""What every collective needs of ``torch.distributed`` itself: the names of its one-tensor
collectives on this torch, and the device a process group exchanges tensors on."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["dist_all_gather", "dist_reduce_scatter", "group_device"]


def dist_all_gather() -> Callable[..., dist.Work | None]:
    """torch's all-gather into one tensor: ``all_gather_single`` (torch >= 2.13, where the old
    name is deprecated) or ``all_gather_into_tensor`` (torch 2.11). Looked up at call time."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def dist_reduce_scatter() -> Callable[..., dist.Work | None]:
    """torch's reduce-scatter of one tensor: ``reduce_scatter_single`` (torch >= 2.13) or
    ``reduce_scatter_tensor`` (torch 2.11). Looked up at call time."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this process's current CUDA device on
    NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
