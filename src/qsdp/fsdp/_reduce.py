"""The FSDP2 gradient reduce-scatter: a thin adapter of a :class:`qsdp.comm.ReducePlan`, with
the per-parameter split and the cross-rank NaN/Inf check. See ``_hooks.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .. import comm as qc
from ..runtime import NonfiniteCheck, nonfinite_flags
from ..runtime.widths import WidthController
from ._hooks import _Context, _Counter, _Hook, _usable
from ._stale import Delay, Pipeline

__all__ = ["QuantizedReduceScatter"]


class _Reduction:
    """What both FSDP2 gradient hooks (the reduce-scatter and HSDP's replicate all-reduce)
    hold: the plan, its noise key, the byte counter, the policy split and the NaN/Inf check."""

    def __init__(
        self,
        *,
        plan: qc.ReducePlan,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        check: NonfiniteCheck | None = None,
        layout: list[tuple[str, int]] | None = None,
        split: qc.Split | None = None,
        module_name: str = "",
    ) -> None:
        if not isinstance(plan, qc.ReducePlan):
            raise TypeError(f"plan must be a qsdp.comm.ReducePlan, got {type(plan).__name__}")
        self.plan, self.check, self.layout, self.split = plan, check, layout, split
        self.module_name = module_name
        self.zeroed = 0
        """Reductions whose output was zeroed for NaN/Inf (counted when the backward ends, see
        ``qsdp.runtime.nonfinite``)."""
        self.seed, self.bucket, self.stats = seed, bucket, stats
        self._steps = _Counter()
        self.delay: Delay | None = None
        """Staleness 1: the reduction in flight (see [Note: staleness 1 in FSDP2])."""
        self.pipeline: Pipeline | None = None
        self.twins: dict[str, dist.ProcessGroup] = {}
        self._group: dist.ProcessGroup | None = None
        """The group the applied result's NaN/Inf flags are agreed over."""
        self.widths: WidthController | None = None
        """Adaptive widths: the model's controller, and this group's key in it."""
        self.width_key = 0

    def _plan_now(self, rows: torch.Tensor, split: qc.Split | None) -> qc.ReducePlan:
        """The plan at this group's width (``CompressionConfig.adaptive``); in a measuring
        backward the group's compressed part of ``rows`` ([ranks or 1, chunk]) is measured
        first (see [Note: adaptive widths at run time])."""
        if self.widths is None:
            return self.plan
        plan = self.plan.with_bits(self.widths.width(self.width_key))
        self.widths.observe(
            self.width_key,
            lambda: split.take(rows)[0] if split is not None else rows,
            plan.width_spec,
        )
        return plan

    def stale(self, *, pipeline: Pipeline, twins: dict[str, dist.ProcessGroup]) -> None:
        """Run at staleness 1 within ``pipeline``, reducing over ``twins`` (by group name)."""
        self.delay, self.pipeline, self.twins = Delay(), pipeline, twins

    def _twin(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        twin = self.twins.get(group.group_name)
        if twin is None:
            raise RuntimeError(
                f"qsdp: FSDP2 reduced over process group {group.group_name!r}, which "
                "compress_fsdp did not see at installation; call compress_fsdp after fully_shard"
            )
        return twin

    def _apply_previous(self, output: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Staleness 1: the previous step's result of this hook into ``output`` (zeros when
        there is none), checked for NaN/Inf."""
        self._group = group
        result = self.delay.finish()
        self.pipeline.applied_nothing = result is None
        if result is None:
            output.zero_()
            return
        output.copy_(result.view_as(output))
        self.check_applied(output)

    def check_applied(self, flat: torch.Tensor) -> None:
        """Zero ``flat`` (a result about to be applied) on every rank if any rank's holds a
        NaN/Inf: per-parameter flags agreed over the hook's group, decided by the check."""
        if self.check is None:
            return
        flags = nonfinite_flags(flat.reshape(1, -1), self.layout)
        flat.masked_fill_(self._agree(flags, self._group), 0)

    def _agree(self, flags: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``flags`` MAX-reduced over ``group`` (every rank then holds the same), counted and
        handed to the check; returns whether any is set, on the device (no host sync)."""
        self.stats.add_bytes("nonfinite_check", flags.numel() * flags.element_size())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        self.check.add(self, flags)
        return flags.any()


class QuantizedReduceScatter(_Reduction, _Hook, ReduceScatter):
    """FSDP2 gradient reduce-scatter through ``plan.reduce_scatter`` (quantized, two-level or
    Global-QSGD integers, as the config's gradient sub-config built it)."""

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
        if self.delay is not None and self.pipeline.synchronous:
            self.pipeline.check_synchronous(self)
        elif self.delay is not None:  # [Note: staleness 1 in FSDP2]
            self._apply_previous(output_tensor, group)
            self.delay.op = "avg" if op == dist.ReduceOp.AVG else str(op)
            step = self._steps.next()
            twin = self._twin(group)
            split = _usable(self.split, input_tensor.numel() // group.size(), self.stats)
            plan = self._plan_now(input_tensor.view(group.size(), -1), split)

            # weight prediction's estimate: from two levels, the own chunk averaged over the
            # node (only the inter-node level need be late, as under compressed HSDP); else
            # this rank's row of the unreduced input
            node = self.pipeline.keep_local and plan.node_level
            estimate = {"node_average": self.delay.set_local} if node else {}

            def launch(result: torch.Tensor) -> None:
                plan.reduce_scatter(
                    result,
                    input_tensor,
                    twin,
                    op=op,
                    split=split,
                    seed=self.seed,
                    step=step,
                    bucket=self.bucket,
                    stats=self.stats,
                    **estimate,
                )

            local = None
            if self.pipeline.keep_local and not node:
                local = input_tensor.view(group.size(), -1)[group.rank()]
            self.delay.send(launch, like=output_tensor, input=input_tensor, local=local)
            return None
        if self.twins:  # CompressionConfig.own_reduce_group: off FSDP2's communicator
            group = self._twin(group)
        split = _usable(self.split, input_tensor.numel() // group.size(), self.stats)
        plan = self._plan_now(input_tensor.view(group.size(), -1), split)
        bad = None
        if self.check is not None:
            flags = nonfinite_flags(
                input_tensor.reshape(group.size(), -1), self.layout, plan.value_limit()
            )
            bad = self._agree(flags, group)
        # AVG or SUM as FSDP asks; a PREMUL_SUM (set_gradient_divide_factor) raises with a fix.
        plan.reduce_scatter(
            output_tensor,
            input_tensor,
            group,
            op=op,
            split=split,
            seed=self.seed,
            step=self._steps.next(),
            bucket=self.bucket,
            stats=self.stats,
        )
        if bad is not None:  # on the device: no host sync, a NaN never reaches the optimizer
            output_tensor.masked_fill_(bad, 0)
        return None
