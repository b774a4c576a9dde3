"""The FSDP2 gradient reduce-scatter: a thin adapter of a :class:`qsdp.comm.ReducePlan`, with
the per-parameter split and the cross-rank NaN/Inf check. See ``_hooks.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .. import comm as qc
from ..quant import zero_flagged
from ..runtime import NonfiniteCheck, nonfinite_flags
from ..runtime.delayed import DelayedReductions, FlagsToAgree, padded_slots
from ..runtime.nonfinite import agree, layout_sizes
from ..runtime.widths import WidthController
from ._hooks import _Context, _Counter, _Hook, _usable

__all__ = ["QuantizedReduceScatter", "compressed_runs"]

# [Note: widths per parameter]
# With ``AdaptiveWidths(per_parameter=True)`` each compressed parameter of a group has its own
# key in the model's WidthController (CGX adapts per layer, i.e. per parameter tensor). A group
# whose parameters all hold one width reduces as before (one collective, bit for bit the
# per-group path). Otherwise it reduces once per width: the columns of that width's parameters
# (each rank's chunk is the concatenation of the parameters' shards) copied into one ``[n, m_w]``
# input, reduced by the plan at that width, copied back; the raw (policy) parameters travel with
# the first width's call, beside its codes. Each call after the first has its own noise key
# (``bucket + k * 2**24``). The bytes are each call's, counted as ever; the cost is one more
# collective (its latency) per extra width in a group.
_SECTION_KEY = 1 << 24


def compressed_runs(layout: list, policy) -> list[tuple[int, int]]:
    """``(start, length)`` in the chunk of each parameter of ``layout`` (``(name, elements,
    shape)`` in chunk order) that ``policy`` compresses (all with no policy), in chunk order."""
    runs, offset = [], 0
    for name, n, shape in layout:
        if n and (policy is None or policy.compresses(name, shape)):
            runs.append((offset, n))
        offset += n
    return runs


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
        params: Sequence[torch.Tensor] = (),
        widths: WidthController | None = None,
        width_key: int = 0,
        param_widths: tuple[list[int], list[tuple[int, int]]] | None = None,
        stale: DelayedReductions | None = None,
        chunk: Sequence[tuple[torch.Tensor, int]] = (),
        twins: Mapping[str, dist.ProcessGroup] | None = None,
        graphs: qc.CodecGraphs | None = None,
    ) -> None:
        """Args, beyond the plan's noise key, counter, check, layout and split: ``params``, the
        parameters whose gradients it makes; ``widths`` and ``width_key``, its adaptive width
        (``param_widths``: a key and a chunk run per compressed parameter, [Note: widths per
        parameter]); ``stale``, the model's reductions in flight at staleness 1, and
        ``chunk``, (parameter, padded elements) of the flat shard it reduces, where it finds
        its parameters' results ([Note: one staleness core] in ``qsdp.runtime.delayed``);
        ``twins``, the reductions' own communicators by group name (``own_reduce_group``,
        staleness 1); ``graphs``, the model's captured codec segments (``Schedule.graphs``:
        the synchronous reduce-scatter replays them)."""
        if not isinstance(plan, qc.ReducePlan):
            raise TypeError(f"plan must be a qsdp.comm.ReducePlan, got {type(plan).__name__}")
        self.plan, self.check, self.layout, self.split = plan, check, layout, split
        self._sizes = layout_sizes(layout)  # (the flags' runs, worked out once)
        self.module_name = module_name
        self.where = ""  # (a report names the module: qsdp.runtime.FlaggedReduction)
        self.zeroed = 0
        """Reductions whose output was zeroed for NaN/Inf (counted when the backward ends, see
        ``qsdp.runtime.nonfinite``)."""
        self.seed, self.bucket, self.stats = seed, bucket, stats
        self._steps = _Counter()
        self.stale = stale
        """Staleness 1: the model's reductions in flight (None: synchronous)."""
        self.slots = padded_slots(chunk)
        """Where each parameter's gradient lies in the flat shard this hook reduces."""
        if stale is not None:
            stale.register(self, self.slots, size=sum(n for _, n in chunk))
        self.twins: Mapping[str, dist.ProcessGroup] = twins or {}
        self.graphs = graphs
        self._group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None
        """The group (or groups, in turn) the applied result's NaN/Inf flags are agreed over."""
        self.params = list(params)
        """The parameters whose gradients this reduction makes (its FSDP group's own), zeroed
        when the backward ends if its flags are set ([Note: one flag agreement per backward])."""
        self.widths, self.width_key = widths, width_key
        """Adaptive widths: the model's controller, and this group's key in it."""
        self.param_keys: list[int] | None = None
        """Widths per parameter: each compressed parameter's key, and its run in the chunk."""
        self.param_runs: list[tuple[int, int]] = []
        if param_widths is not None:
            keys, runs = param_widths
            if len(keys) != len(runs):
                raise ValueError(f"{len(keys)} width keys for {len(runs)} compressed parameters")
            self.param_keys, self.param_runs = keys, runs

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

    def _sections_now(
        self, rows: torch.Tensor, split: qc.Split | None
    ) -> list[tuple[qc.ReducePlan, list[tuple[int, int]] | None, qc.Split | None, int]]:
        """``(plan, column runs or None for the whole chunk, split, bucket)`` of each call this
        group's reduce-scatter makes now ([Note: widths per parameter]); one call unless its
        parameters hold several widths. Measures each parameter in a measuring backward."""
        if self.param_keys is None:
            return [(self._plan_now(rows, split), None, split, self.bucket)]
        ref = self.plan.with_bits(self.widths.reference)
        if self.layout is None or sum(n for _, n in self.layout) != rows.shape[1]:
            # FSDP2 handed over another chunk than the layout's (a parameter without a gradient
            # this step): the reference width for the group, nothing measured, counted
            self.stats.count_call("widths_skipped")
            return [(ref, None, split, self.bucket)]
        widths = []
        for key, (start, n) in zip(self.param_keys, self.param_runs, strict=True):
            self.widths.observe(
                key, lambda s=start, n=n: rows[:, s : s + n].contiguous(), ref.width_spec
            )
            widths.append(self.widths.width(key))
        if len(set(widths)) <= 1:
            plan = self.plan.with_bits(widths[0]) if widths else self.plan
            return [(plan, None, split, self.bucket)]
        raw = [(s, n) for s, n, c in split.runs if not c] if split is not None else []
        sections = []
        for k, bits in enumerate(sorted(set(widths))):
            runs = [r for r, w in zip(self.param_runs, widths, strict=True) if w == bits]
            sub = None
            if k == 0 and raw:  # the raw parameters beside the first width's codes
                runs = sorted(runs + raw)
                sub = qc.Split.of((n, (s, n) not in raw) for s, n in runs)
            sections.append((self.plan.with_bits(bits), runs, sub, self.bucket + k * _SECTION_KEY))
        return sections

    def _twin(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        twin = self.twins.get(group.group_name)
        if twin is None:
            raise RuntimeError(
                f"qsdp: FSDP2 reduced over process group {group.group_name!r}, which "
                "compress_fsdp did not see at installation; call compress_fsdp after fully_shard"
            )
        return twin

    def _apply_previous(
        self, output: torch.Tensor, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...]
    ) -> bool:
        """Staleness 1: the previous step's result of this hook into ``output`` (zeros when
        there is none), checked for NaN/Inf; the flags are agreed over ``group`` (or each of
        several in turn). Whether there was one."""
        self._group = group
        result = self.stale.previous(self.slots, like=output)
        if result is None:
            output.zero_()
            return False
        output.copy_(result)
        if self.check is None:
            return True
        agreed = self.stale.agreed_flags(self.slots)
        if agreed is not None:  # agreed where it was reduced: acted on when the backward ends
            if agreed.is_cuda:  # (written on a side stream, read on this one)
                agreed.record_stream(torch.cuda.current_stream(agreed.device))
            self.check.add(self, agreed, params=self.params)
            return True
        flags = nonfinite_flags(output, self.layout, sizes=self._sizes)
        self._defer(flags, group)  # agreed, and acted on, when the backward ends
        return True

    def check_applied(self, flat: torch.Tensor) -> None:
        """Zero ``flat`` (a result about to be applied outside a backward: ``drain()``) on
        every rank if any rank's holds a NaN/Inf: per-parameter flags agreed over the hook's
        group now, decided by the check."""
        if self.check is None:
            return
        flags = nonfinite_flags(flat, self.layout, sizes=self._sizes)
        zero_flagged(flat, self._agree(flags, self._group))

    def _defer(
        self, flags: torch.Tensor, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...]
    ) -> None:
        """This rank's ``flags``, counted and handed to the check, which agrees them over
        ``group`` (or each of several in turn) with the other reductions' when the backward
        ends and zeroes :attr:`params`' gradients where any rank's is set ([Note: one flag
        agreement per backward] in ``qsdp.runtime.nonfinite``)."""
        self.stats.add_bytes("nonfinite_check", flags.numel() * flags.element_size())
        self.check.add(self, flags, group=group, params=self.params)

    def _agree(
        self, flags: torch.Tensor, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...]
    ) -> torch.Tensor:
        """``flags`` MAX-reduced over ``group`` (or each of several in turn: every rank then
        holds the same), counted and handed to the check; returns whether any is set, on the
        device (no host sync)."""
        self.stats.add_bytes("nonfinite_check", flags.numel() * flags.element_size())
        agree(flags, group)
        self.check.add(self, flags)
        return flags.any()


class QuantizedReduceScatter(_Reduction, _Hook, ReduceScatter):
    """FSDP2 gradient reduce-scatter through ``plan.reduce_scatter`` (quantized, two-level or
    Global-QSGD integers, as the config's gradient sub-config built it)."""

    ahead = None
    """``Schedule(gather_ahead=True)``: the group's weight-difference all-gather, which gathers
    the next step's weights once this hook has applied the step's gradient
    ([Note: the next step's weights in this backward] in ``qsdp.runtime.gathered``)."""

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
        if self.stale is not None and self.stale.reduce_now:
            self.stale.check_synchronous(self.slots)
        elif self.stale is not None:  # [Note: one staleness core]
            applied = self._apply_previous(output_tensor, group)
            step = self._steps.next()
            twin = self._twin(group)
            split = _usable(self.split, input_tensor.numel() // group.size(), self.stats)
            plan = self._plan_now(input_tensor.view(group.size(), -1), split)

            # weight prediction's estimate: from two levels, the own chunk averaged over the
            # node (only the inter-node level need be late, as under compressed HSDP); else
            # this rank's row of the unreduced input
            node = self.stale.keep_local and plan.node_level
            # replayed on the side stream the launch runs on ([Note: codec segments replayed])
            replay = {"graphs": self.graphs} if self.graphs is not None and plan.replayable else {}

            def launch(result: torch.Tensor, keep) -> FlagsToAgree | None:
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
                    **({"node_average": keep} if node else {}),
                    **replay,
                )
                if self.check is None:
                    return None
                # [Note: flags agreed where they were reduced] (qsdp.runtime.delayed)
                flags = nonfinite_flags(result, self.layout, sizes=self._sizes)
                self.stats.add_bytes("nonfinite_check", flags.numel() * flags.element_size())
                return FlagsToAgree(flags, twin)

            local = None
            if self.stale.keep_local and not node:
                local = input_tensor.view(group.size(), -1)[group.rank()]
            self.stale.send(
                launch,
                key=self,
                slots=self.slots,
                like=output_tensor,
                input=input_tensor,
                owner=self,
                op="avg" if op == dist.ReduceOp.AVG else str(op),
                reuse=True,  # (its result was copied into FSDP2's output above)
                local=local,
            )
            # [Note: the next step's weights in this backward] (qsdp.runtime.gathered): the step
            # applies what was just written into FSDP2's output (an average under AVG)
            if self.ahead is not None and applied and op == dist.ReduceOp.AVG:
                self.ahead.gather_ahead(
                    applied=output_tensor,
                    slots=self.slots,
                    estimates=lambda: self.stale.estimates_of(self.slots),
                )
            return None
        if self.twins:  # Schedule.own_reduce_group: off FSDP2's communicator
            group = self._twin(group)
        rows = input_tensor.view(group.size(), -1)
        split = _usable(self.split, rows.shape[1], self.stats)
        sections = self._sections_now(rows, split)
        if self.check is not None:  # agreed, and acted on, when the backward ends
            limit = min(plan.value_limit() for plan, *_ in sections)
            flags = nonfinite_flags(rows, self.layout, limit, sizes=self._sizes)
            self._defer(flags, group)
        step = self._steps.next()
        for plan, runs, sub, bucket in sections:
            # AVG or SUM as FSDP asks; a PREMUL_SUM (set_gradient_divide_factor) raises with a
            # fix. A section ([Note: widths per parameter]) reduces its columns only.
            part_in = (
                input_tensor
                if runs is None
                else torch.cat([rows[:, s : s + n] for s, n in runs], 1)
            )
            part_out = output_tensor
            replay = {}
            if runs is not None:
                part_out = output_tensor.new_empty(part_in.shape[1])
            elif self.graphs is not None and plan.replayable:
                replay = {"graphs": self.graphs}  # [Note: codec segments replayed]
            plan.reduce_scatter(
                part_out,
                part_in,
                group,
                op=op,
                split=sub,
                seed=self.seed,
                step=step,
                bucket=bucket,
                stats=self.stats,
                **replay,
            )
            if runs is not None:
                torch._foreach_copy_(
                    [output_tensor.view(-1)[s : s + n] for s, n in runs],
                    list(part_out.split([n for _, n in runs])),
                )
        if self.stale is not None:  # before staleness 1 starts ([Note: when staleness 1 starts])
            self.stale.reduced_now(output_tensor, group)
        return None
