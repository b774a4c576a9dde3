"""The elastic-consistency bound of staleness 1: a gate that forces a synchronous step.

[Note: the staleness gate]
At staleness 1, step ``t`` applies the gradient reduced from step ``t - 1``'s backward while step
``t``'s own gradient is still in flight. The parameters a worker computes on then lag the
synchronous iterate (every computed gradient applied) by one update, the one in flight. Elastic
consistency asks that this distance stay bounded. The gate measures the size of the update the
step applies, ``lr * ||g||`` with ``||g||`` the global norm of the applied gradient after
clipping, as the proxy of ``||x_stale - x_sync||`` (an update in flight is about the size of the
one just applied; for SGD it is that distance exactly, for Adam a scale of it). When the proxy
exceeds the configured bound the caller synchronises: it applies the gradient of this step as
usual, then drains the reduction in flight and applies it too (the parameters are now the
synchronous iterate of the gradients computed so far), and runs the next step synchronously
(its backward under ``synchronous()``: reduced and applied in the same step, exactly the
synchronous step). The step after that restarts the pipeline and applies nothing
(``applied_nothing``: skip its optimizer step), so every gradient is applied exactly once, in
order.

The norm must be the same on every rank, so every rank takes the same branch: the norm of an
all-reduced gradient (DDP, whose replicas hold identical gradients) or of a sharded one reduced
over the shards (``clip_grad_norm_`` on FSDP2's DTensor gradients all-reduces it).
"""

from __future__ import annotations

import math

import torch

__all__ = ["StalenessGate"]


class StalenessGate:
    """Decides, from a replica-identical gradient norm, when staleness 1 must synchronise.

    Args:
        bound: the largest allowed ``lr * ||g||`` (see [Note: the staleness gate]); ``inf``
            never forces a synchronous step but still measures the proxy.
    """

    def __init__(self, bound: float = math.inf) -> None:
        if not isinstance(bound, (int, float)) or not bound > 0:
            raise ValueError(
                f"the staleness bound must be a positive number (lr * gradient norm) or inf, got "
                f"{bound!r}"
            )
        self.bound = float(bound)
        self.fired = 0
        """Synchronous steps the gate forced so far."""
        self.gap = 0.0
        """The last step's proxy of ``||x_stale - x_sync||``: ``lr * ||g||``."""

    def check(
        self, *, grad_norm: torch.Tensor | float, lr: float, clip: float | None = None
    ) -> bool:
        """Whether this step must synchronise; ``grad_norm`` is the applied gradient's global
        norm before clipping (what ``clip_grad_norm_`` returns), ``clip`` its clipping
        threshold. A non-finite norm forces a synchronous step too. One host read."""
        norm = float(grad_norm)
        if clip is not None and norm > clip:
            norm = clip
        self.gap = lr * norm
        fire = not self.gap <= self.bound
        self.fired += int(fire)
        return fire
