"""Which groups of encoded payloads were flagged (NaN/Inf, or not representable): read on the
device, without a host sync, so a collective can agree on them across ranks first."""

from __future__ import annotations

import torch

from .spec import QuantSpec

__all__ = ["flagged_groups"]


def flagged_groups(payloads: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """Number of flagged groups in ``k`` payloads stacked as ``[k, payload_bytes]``.

    An encode marks a group it cannot represent (NaN/Inf in it, or a range past float32) by a
    NaN first scale field (``qsdp.quant.reference``); this counts them.

    Args:
        payloads: uint8 ``[k, spec.payload_bytes(numel)]`` (rows may be strided), or 1-D for one.
        numel: elements each payload encodes.
        spec: the quantizer that made them.

    Returns:
        An int64 scalar tensor on the payloads' device (read it with ``int()`` when needed).
    """
    rows = payloads.reshape(1, -1) if payloads.dim() == 1 else payloads
    if numel == 0 or rows.shape[0] == 0:
        return torch.zeros((), dtype=torch.int64, device=rows.device)
    ng = spec.num_groups(numel)
    # the scales lead each payload; a copy makes them aligned for the float view
    raw = rows[:, : ng * spec.scale_bytes].contiguous().reshape(-1, spec.scale_bytes)
    first = raw.view(spec.scale_dtype)[:, 0]
    return torch.isnan(first).sum()
