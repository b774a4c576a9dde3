"""``compress_fsdp``: one call after the user's ``fully_shard`` calls."""

from __future__ import annotations

import weakref

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..comm import CommStats
from ..config import CompressionConfig, recipe
from .comms import QuantizedAllGather, QuantizedReduceScatter

__all__ = ["compress_fsdp", "fsdp_comm_stats"]

_STATS: weakref.WeakKeyDictionary[nn.Module, CommStats] = weakref.WeakKeyDictionary()


def compress_fsdp(
    model: nn.Module, config: CompressionConfig | str, *, mesh: object | None = None
) -> nn.Module:
    """Route every ``FSDPModule`` of ``model`` through qsdp's compressed collectives.

    Call it after ``fully_shard`` (on the blocks, then the root). Parameters, optimizer and
    training loop stay as they are; only what FSDP2 sends changes.

    Args:
        model: a model whose modules were wrapped by ``torch.distributed.fsdp.fully_shard``.
        config: a :class:`qsdp.CompressionConfig` or a recipe name (``"qsdp-w8g8"``, ...).
        mesh: reserved for the two-level (inter, intra) gradient path; only ``None`` (each
            module's own FSDP group, one level) is supported yet.

    Returns:
        ``model``, modified in place. :func:`fsdp_comm_stats` gives its byte counter.

    Raises:
        ValueError: no FSDPModule in ``model``, an unknown recipe.
        NotImplementedError: a ``mesh`` (two-level gradients are not built yet).
    """
    if isinstance(config, str):
        config = recipe(config)
    elif not isinstance(config, CompressionConfig):
        raise TypeError(
            f"config must be a qsdp.CompressionConfig or a recipe name, got {type(config).__name__}"
        )
    if mesh is not None:
        raise NotImplementedError(
            "compress_fsdp(mesh=...) is for SDP4Bit's two-level gradients, which are not built "
            "yet; pass mesh=None to compress over each module's FSDP group"
        )
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            "compress_fsdp found no FSDPModule in the model: call "
            "torch.distributed.fsdp.fully_shard on its blocks and its root first"
        )
    stats = CommStats()
    for i, module in enumerate(modules):
        if config.weights is not None:
            module.set_custom_all_gather(
                QuantizedAllGather(config.weights, seed=config.seed, bucket=2 * i, stats=stats)
            )
        if config.grads is not None or config.grad_carrier is not None:
            module.set_custom_reduce_scatter(
                QuantizedReduceScatter(
                    spec=config.grads,
                    carrier=config.grad_carrier,
                    group_size=config.grad_group_size,
                    seed=config.seed,
                    bucket=2 * i + 1,
                    stats=stats,
                )
            )
    _STATS[model] = stats
    return model


def fsdp_comm_stats(model: nn.Module) -> CommStats:
    """The byte counter of the collectives :func:`compress_fsdp` installed on ``model``."""
    if model not in _STATS:
        raise ValueError("this model was not passed to qsdp.compress_fsdp")
    return _STATS[model]
