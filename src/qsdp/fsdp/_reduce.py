"""The FSDP2 gradient reduce-scatter: quantized (one or two levels) or Global-QSGD integers,
with the per-parameter split and the cross-rank NaN/Inf check. See ``_hooks.py``."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .. import comm as qc
from ..comm._common import parse_op as qc_parse_op
from ..comm._common import reduce_scatter_sum as counted_reduce_scatter_sum
from ..quant import QuantSpec
from ._hooks import _Context, _Counter, _Hook, _usable
from ._nonfinite import NonfiniteCheck, nonfinite_flags
from ._split import Split

__all__ = ["QuantizedReduceScatter"]


class QuantizedReduceScatter(_Hook, ReduceScatter):
    """FSDP2 gradient reduce-scatter through :func:`qsdp.comm.reduce_scatter` (a spec) or
    :func:`qsdp.comm.integer_reduce_scatter` (a Global-QSGD carrier)."""

    def __init__(
        self,
        *,
        spec: QuantSpec | None,
        carrier: str | None,
        group_size: int,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        inter_spec: QuantSpec | None = None,
        mesh: object | None = None,
        nonfinite: str = "raise",
        check: NonfiniteCheck | None = None,
        layout: list[tuple[str, int]] | None = None,
        split: Split | None = None,
        module_name: str = "",
    ) -> None:
        if (spec is None) == (carrier is None):
            raise ValueError("QuantizedReduceScatter needs exactly one of spec and carrier")
        if mesh is not None and inter_spec is None:
            raise ValueError("QuantizedReduceScatter(mesh=...) needs the inter-node inter_spec")
        # The check below (or "propagate") decides about NaN/Inf: the encoders must not raise
        # on one rank alone (its peers would wait for it until the timeout).
        self.spec = replace(spec, nonfinite="propagate") if spec is not None else None
        self.inter_spec = (
            replace(inter_spec, nonfinite="propagate") if inter_spec is not None else None
        )
        self.carrier, self.group_size, self.mesh = carrier, group_size, mesh
        if (nonfinite == "propagate") != (check is None):
            raise ValueError("QuantizedReduceScatter needs a NonfiniteCheck unless 'propagate'")
        self.nonfinite, self.layout, self.module_name = nonfinite, layout, module_name
        self.check = check
        self.split = split
        self.zeroed = 0
        """Reduce-scatters whose output was zeroed for NaN/Inf (counted when the backward
        ends, see ``_nonfinite.py``)."""
        self.seed, self.bucket, self.stats = seed, bucket, stats
        self._steps = _Counter()

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        with _Context("reduce-scatter", self.module_name):
            return self._call(output_tensor, input_tensor, group, op)

    def _call(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
    ) -> None:
        bad = None
        if self.check is not None:
            flags = nonfinite_flags(input_tensor.reshape(group.size(), -1), self.layout)
            self.stats.add_bytes("nonfinite_check", flags.numel() * flags.element_size())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            self.check.add(self, flags)
            bad = flags.any()
        self._reduce_split(output_tensor, input_tensor, group, op)
        if bad is not None:  # on the device: no host sync, a NaN never reaches the optimizer
            output_tensor.masked_fill_(bad, 0)
        return None

    def _reduce_split(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
    ) -> None:
        n = group.size()
        split = _usable(self.split, input_tensor.numel() // n, self.stats)
        if split is None:
            self._reduce(output_tensor, input_tensor, group, op)
            return None
        comp_rows, raw_rows = split.take(input_tensor.view(n, -1))
        comp, raw = comp_rows.reshape(-1), raw_rows.reshape(-1)
        comp_out = torch.empty(split.n_comp, dtype=comp.dtype, device=comp.device)
        raw_out = torch.empty(split.n_raw, dtype=raw.dtype, device=raw.device)
        if comp.numel():
            self._reduce(comp_out, comp, group, op)
        if raw.numel():
            counted_reduce_scatter_sum(raw_out, raw, group, self.stats, "reduce_scatter_raw").wait()
            if qc_parse_op(op) == "avg":
                raw_out.div_(n)
        split.put(output_tensor.view(1, -1), comp_out.view(1, -1), raw_out.view(1, -1))
        return None

    def _reduce(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
    ) -> None:
        # AVG or SUM as FSDP asks; a PREMUL_SUM (set_gradient_divide_factor) raises with a fix.
        key = dict(seed=self.seed, step=self._steps.next(), bucket=self.bucket, stats=self.stats)
        if self.carrier is not None:
            qc.integer_reduce_scatter(
                output_tensor,
                input_tensor,
                group,
                carrier=self.carrier,
                op=op,
                group_size=self.group_size,
                nonfinite="propagate",  # decided by this hook, once per backward
                **key,
            )
        elif self.mesh is not None:  # checked against FSDP's group by compress_fsdp
            qc.hierarchical_reduce_scatter(
                output_tensor,
                input_tensor,
                mesh=self.mesh,
                group=group,  # FSDP's layout: chunk j for its group's rank j, any mesh order
                intra_spec=self.spec,
                inter_spec=self.inter_spec,
                op=op,
                **key,
            )
        else:
            qc.reduce_scatter(output_tensor, input_tensor, group, spec=self.spec, op=op, **key)
        return None
