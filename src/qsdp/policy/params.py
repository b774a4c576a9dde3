"""Per-parameter compression filter (QSDP and CGX keep small and 1-D tensors exact) and the
:class:`qsdp.comm.Split` it makes of a flat buffer."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from ..comm import Split

__all__ = ["ParamPolicy"]


@dataclass(frozen=True, kw_only=True)
class ParamPolicy:
    """Parameters that travel uncompressed inside flat buffers (FSDP2 groups, DDP buckets); the
    rest are quantized.

    The defaults are QSDP's and CGX's: biases and norms (1-D) and tensors under 1024 elements
    carry little traffic and much sensitivity.
    """

    min_numel: int = 1024
    """Parameters with fewer elements travel uncompressed."""
    keep_1d: bool = True
    """1-D parameters (biases, norm weights) travel uncompressed."""
    uncompressed: tuple[str, ...] = ()
    """``fnmatch`` patterns of parameter names (as ``model.named_parameters()`` gives them)
    that travel uncompressed, e.g. ``("*.embed.weight",)``."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"ParamPolicy.min_numel={self.min_numel!r} must be an int >= 0")
        if isinstance(self.uncompressed, str) or not all(
            isinstance(p, str) for p in self.uncompressed
        ):
            raise TypeError(
                f"ParamPolicy.uncompressed={self.uncompressed!r} must be a tuple of name patterns"
            )

    def compresses(self, name: str, shape: Sequence[int]) -> bool:
        """Whether the parameter ``name`` of the full (unsharded) ``shape`` is quantized."""
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel < self.min_numel or (self.keep_1d and len(shape) <= 1):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.uncompressed)

    def split(self, layout: Sequence[tuple[str, int, Sequence[int]]]) -> Split | None:
        """The :class:`~qsdp.comm.Split` of a flat chunk laid out as ``(name, elements in the
        chunk, full shape)`` segments in order; None when every parameter is compressed.

        Args:
            layout: one entry per parameter (its shard's padded length for FSDP2, its numel
                for a DDP bucket), in the order the chunk holds them.

        Returns:
            A split whose runs cover the chunk, neighbours of one kind merged, or None.
        """
        keep = [self.compresses(name, shape) for name, _, shape in layout]
        if all(keep):
            return None
        return Split.of(
            ((n, k) for (_, n, _), k in zip(layout, keep, strict=True)),
            raw_names=tuple(name for (name, _, _), k in zip(layout, keep, strict=True) if not k),
        )
