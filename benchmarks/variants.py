"""The ``+gN`` option the step benchmarks share: a recipe's gradients in groups of N."""

from __future__ import annotations

from dataclasses import replace

import qsdp


def group_size(options: list[str]) -> int:
    """N of a ``gN`` among a variant's ``+options``, or 0."""
    return next((int(o[1:]) for o in options if o.startswith("g") and o[1:].isdigit()), 0)


def with_group_size(config: qsdp.CompressionConfig, group: int) -> qsdp.CompressionConfig:
    """``config`` with its gradients quantized in groups of ``group`` (a quantizer spec's, or
    integer codes' scale groups); refuses a recipe without either."""
    grads = config.grads
    if hasattr(grads, "spec"):
        grads = replace(grads, spec=replace(grads.spec, group_size=group))
    elif hasattr(grads, "group_size"):
        grads = replace(grads, group_size=group)
    else:
        raise SystemExit(
            f"+g{group}: this recipe's gradients ({type(grads).__name__}) have no group size; "
            "use +gN with cgx, qsdp-g8, qsdp-w8g8 or global-qsgd"
        )
    return replace(config, grads=grads)
