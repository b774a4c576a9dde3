"""A parameter's local tensor and back: FSDP2's sharded parameters are DTensors, DDP's plain."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["like_param", "local_of"]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its local shard for a DTensor, ``t`` itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part, shaped as ``param``'s local tensor) as a tensor placed like
    ``param``: a DTensor on its mesh with its placements, or ``local`` itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
