"""Typed configuration of what qsdp compresses, and the named recipes built from one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .quant import CARRIERS, QuantSpec

__all__ = ["RECIPES", "CompressionConfig", "recipe"]


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """What crosses the wire in FSDP2's collectives; ``None`` leaves a collective uncompressed."""

    weights: QuantSpec | None = None
    """Quantizer of the parameter all-gather (every rank decodes every shard, its own too)."""
    grads: QuantSpec | None = None
    """Quantizer of the single-level gradient reduce-scatter (all-to-all, fp32 accumulation)."""
    grad_carrier: str | None = None
    """Global-QSGD integer reduce-scatter on this carrier (``int8``, ``fp16``, ``int32``);
    exclusive with ``grads``."""
    grad_group_size: int = 128
    """Elements sharing one scale in the integer reduce-scatter."""
    seed: int = 0
    """Key of the stochastic-rounding noise, the same on every rank (streams differ by rank)."""

    def __post_init__(self) -> None:
        for name in ("weights", "grads"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, QuantSpec):
                raise TypeError(f"CompressionConfig.{name} must be a QuantSpec or None")
        if self.grads is not None and self.grad_carrier is not None:
            raise ValueError(
                "CompressionConfig: set grads (quantized reduce-scatter) or grad_carrier "
                "(Global-QSGD integer reduce-scatter), not both"
            )
        if self.grad_carrier is not None and self.grad_carrier not in CARRIERS:
            raise ValueError(
                f"CompressionConfig.grad_carrier={self.grad_carrier!r} must be one of "
                f"{sorted(CARRIERS)}"
            )
        g = self.grad_group_size
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"CompressionConfig.grad_group_size={g!r} must be a positive int")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"CompressionConfig.seed={self.seed!r} must be an int in [0, 2**64)")


def _bf16() -> CompressionConfig:
    return CompressionConfig()


def _qsdp_w8g8() -> CompressionConfig:
    # QSDP: 8-bit weights (deterministic, the fp32 master shards stay exact) and 8-bit min-max
    # gradients with stochastic rounding (unbiased), groups of 128.
    return CompressionConfig(
        weights=QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest"),
        grads=QuantSpec(bits=8, group_size=128, scheme="minmax", rounding="stochastic"),
    )


def _global_qsgd() -> CompressionConfig:
    return CompressionConfig(grad_carrier="int8")


def _w4_direct() -> CompressionConfig:
    # SDP4Bit's ablation: weights quantized directly to 4 bits on every gather (no differences).
    return CompressionConfig(
        weights=QuantSpec(bits=4, group_size=128, scheme="absmax", rounding="stochastic"),
    )


#: Named recipes. The SDP4Bit family (weight differences, two-level gradients) is not built yet.
RECIPES: dict[str, Callable[[], CompressionConfig]] = {
    "bf16": _bf16,
    "qsdp-w8g8": _qsdp_w8g8,
    "global-qsgd": _global_qsgd,
    "w4-direct": _w4_direct,
}


def recipe(name: str) -> CompressionConfig:
    """The :class:`CompressionConfig` of a named recipe (see :data:`RECIPES`)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name]()
