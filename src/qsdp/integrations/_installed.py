"""What every framework adapter hands back: the module carrying qsdp's hooks and its state, and
the one call that installs them (``qsdp.ddp.register`` on a DDP wrapper, ``qsdp.compress_fsdp``
on FSDP2's root module). The adapters (``hf``, ``lightning``) differ only in where they find the
model and what they refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import CompressionConfig, Schedule, compress_fsdp
from ..comm import CommStats
from ..ddp import DDPCompression, register
from ..fsdp import CommState, comm_state, fsdp_comm_stats

__all__ = ["Compressed", "install"]


@dataclass(frozen=True, kw_only=True)
class Compressed:
    """What an adapter installed on the model its framework prepared."""

    model: nn.Module
    """The module carrying qsdp's hooks: FSDP2's root module or the DDP wrapper."""
    state: CommState | DDPCompression
    """qsdp's state of it (``qsdp.fsdp.comm_state(model)``, or what ``qsdp.ddp.register``
    returned): ``check_nonfinite()``, ``zeroed``, ``state_dict()`` for a checkpoint, ``drain()``
    at staleness 1."""

    @property
    def stats(self) -> CommStats:
        """Bytes and calls qsdp handed to ``torch.distributed`` so far."""
        if isinstance(self.state, DDPCompression):
            return self.state.stats
        return fsdp_comm_stats(self.model)


def install(
    target: nn.Module,
    config: CompressionConfig | str,
    *,
    schedule: Schedule | None,
    options: dict[str, Any],
) -> Compressed:
    """qsdp on ``target``: a DDP wrapper through :func:`qsdp.ddp.register`, FSDP2's root module
    through :func:`qsdp.compress_fsdp` (``options``: their keyword arguments)."""
    if isinstance(target, DistributedDataParallel):
        hook = register(target, config, schedule=schedule, **options)
        return Compressed(model=target, state=hook)
    compress_fsdp(target, config, schedule=schedule, **options)
    return Compressed(model=target, state=comm_state(target))
