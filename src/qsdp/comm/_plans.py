"""Reduce plans: one object per way of reducing gradients, shared by every integration.

[Note: one core, three integrations]
FSDP2's reduce-scatter hook, HSDP's replicate all-reduce hook and DDP's comm hook differ only in
their calling conventions. Each adapts to a :class:`ReducePlan`, which a gradient sub-config of
``qsdp.CompressionConfig`` builds (``config.grads.plan(...)``): the plan knows which
:mod:`qsdp.comm` collective runs a reduce-scatter and which an all-reduce, and how many bytes
each hands to ``torch.distributed``. Noise keys (``seed``, ``step``, ``bucket``), the policy
split and the byte counter come from the caller.

=======================  ===============================  ==================================
plan                     reduce_scatter                   all_reduce
=======================  ===============================  ==================================
``QuantizedReduce``      :func:`reduce_scatter`           :func:`two_phase_all_reduce` (CGX)
``TwoLevelReduce``       :func:`hierarchical_reduce_scatter`  (a reduce-scatter only)
``IntegerReduce``        :func:`integer_reduce_scatter`   :func:`integer_all_reduce`
``PlainReduce``          the backend's, counted           the backend's all-reduce, counted
=======================  ===============================  ==================================

``PlainReduce`` is "uncompressed" for the integrations that run a reduction themselves (DDP,
HSDP's replicate hook, FSDP2's reduce-scatter at staleness 1), so they need no second path for
it. (A synchronous uncompressed FSDP2 reduce-scatter stays FSDP2's own: no hook is installed.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..quant import QuantSpec, Rounding
from . import _common as C
from ._common import CommWork
from ._hierarchical import hierarchical_reduce_scatter, hierarchical_reduce_scatter_wire_bytes
from ._integer import (
    integer_all_reduce,
    integer_all_reduce_wire_bytes,
    integer_reduce_scatter,
    integer_reduce_scatter_wire_bytes,
)
from ._reduce_scatter import reduce_scatter, reduce_scatter_wire_bytes
from ._split import Split
from ._two_phase import two_phase_all_reduce, two_phase_all_reduce_wire_bytes

__all__ = ["IntegerReduce", "PlainReduce", "QuantizedReduce", "ReducePlan", "TwoLevelReduce"]


class ReducePlan:
    """How gradients are reduced; see [Note: one core, three integrations].

    Every method takes keyword arguments only beyond the tensors and the group:
    ``op`` (``"avg"``/``"sum"`` or ``ReduceOp.AVG``/``SUM``), ``split`` (a
    :class:`~qsdp.comm.Split` or None), ``seed``/``step``/``bucket`` (noise key), ``stats``
    (byte counter) and ``async_op``.
    """

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, **kw
    ) -> CommWork | None:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, **kw) -> CommWork | None:
        raise ValueError(
            f"{type(self).__name__} reduces only by reduce-scatter; an all-reduce (DDP, HSDP's "
            "replicate dimension) takes a quantized or integer gradient config, e.g. the "
            "recipes 'cgx', 'qsdp-g8' or 'global-qsgd'"
        )

    @property
    def width_spec(self) -> QuantSpec | None:
        """The quantizer whose width adaptive widths vary (None: the plan has none)."""
        return None

    @property
    def replayable(self) -> bool:
        """Whether :meth:`reduce_scatter` takes ``graphs=`` (a :class:`~qsdp.comm.CodecGraphs`
        to replay its codec from: the single-level quantized reduce-scatter, and the two-level
        one)."""
        return False

    @property
    def node_level(self) -> bool:
        """Whether :meth:`reduce_scatter` reduces inside the node first (two levels over a
        mesh): then it takes ``node_average=`` (see :func:`hierarchical_reduce_scatter`)."""
        return False

    def with_bits(self, bits: int) -> ReducePlan:
        """This plan with :attr:`width_spec` at ``bits`` bits."""
        raise ValueError(f"{type(self).__name__} has no quantizer width to vary")

    def value_limit(self) -> float:
        """Largest ``|x|`` the plan's quantizers always represent (``QuantSpec.value_limit``):
        an integration that checks its input against it (instead of only for NaN/Inf) also
        catches groups a quantizer would send as NaN for being too large."""
        return float("inf")

    def reduce_scatter_wire_bytes(
        self, numel: int, world_size: int, *, split: Split | None = None, element_size: int = 4
    ) -> int:
        raise NotImplementedError

    def all_reduce_wire_bytes(
        self, numel: int, world_size: int, *, split: Split | None = None, element_size: int = 4
    ) -> int:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class PlainReduce(ReducePlan):
    """Uncompressed: the backend's own SUM all-reduce, scaled by 1/n first for ``"avg"`` (as DDP's
    default hook does), counted under ``name``. Every element travels as it is, so a split
    changes nothing and the noise key is unused."""

    name: str = "all_reduce"
    """The byte counter's key."""

    def all_reduce(self, tensor, group, *, op="avg", stats=None, async_op=False, **_):
        op, stats = C.parse_op(op), C.resolve_stats(stats)
        stats.count_call(self.name)
        if op == "avg":  # times 1/n, as DDP's own all-reduce scales (the same bits)
            tensor.mul_(1.0 / dist.get_world_size(group))

        def stages() -> C.Stages:
            yield [C.all_reduce(tensor, dist.ReduceOp.SUM, group, stats, self.name)], True

        return C.run_stages(stages(), async_op, result=tensor)

    def reduce_scatter(self, output, input, group, *, op="avg", stats=None, async_op=False, **_):
        op, stats = C.parse_op(op), C.resolve_stats(stats)
        name = "reduce_scatter" if self.name == "all_reduce" else self.name
        stats.count_call(name)
        # the backend's own AVG, as FSDP2's reduce-scatter runs it: the same bits
        reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM

        def stages() -> C.Stages:
            stats.add_bytes(name, (input.numel() - output.numel()) * input.element_size())
            yield (
                [C.start(C.dist_reduce_scatter(), output, input, op=reduce_op, group=group)],
                True,
            )

        return C.run_stages(stages(), async_op, result=output)

    def all_reduce_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        return numel * element_size

    def reduce_scatter_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        return (numel - numel // world_size) * element_size


@dataclass(frozen=True, kw_only=True)
class QuantizedReduce(ReducePlan):
    """Codes through an all-to-all (QSDP, CGX): one quantization per element and hop."""

    spec: QuantSpec

    @property
    def width_spec(self) -> QuantSpec:
        return self.spec

    @property
    def replayable(self) -> bool:
        return True

    def with_bits(self, bits: int) -> QuantizedReduce:
        return self if bits == self.spec.bits else replace(self, spec=replace(self.spec, bits=bits))

    def value_limit(self) -> float:
        return self.spec.value_limit()

    def reduce_scatter(self, output, input, group, **kw):
        return reduce_scatter(output, input, group, spec=self.spec, **kw)

    def all_reduce(self, tensor, group, **kw):
        return two_phase_all_reduce(tensor, group, spec=self.spec, **kw)

    def reduce_scatter_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        return reduce_scatter_wire_bytes(
            numel, world_size, self.spec, split=split, element_size=element_size
        )

    def all_reduce_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        return two_phase_all_reduce_wire_bytes(
            numel, world_size, self.spec, split=split, element_size=element_size
        )


@dataclass(frozen=True, kw_only=True)
class TwoLevelReduce(ReducePlan):
    """SDP4Bit's TLq-HS over a 2-D mesh; without a mesh every peer is remote (``inter``)."""

    intra: QuantSpec
    inter: QuantSpec
    mesh: DeviceMesh | None = None

    @property
    def width_spec(self) -> QuantSpec:
        return self.inter  # the slow link's quantizer

    def with_bits(self, bits: int) -> TwoLevelReduce:
        if bits == self.inter.bits:
            return self
        return replace(self, inter=replace(self.inter, bits=bits))

    def value_limit(self) -> float:
        return min(self.intra.value_limit(), self.inter.value_limit())

    @property
    def node_level(self) -> bool:
        return self.mesh is not None

    @property
    def replayable(self) -> bool:
        return True  # (two levels: [Note: two levels replayed]; one: the single-level's)

    def reduce_scatter(self, output, input, group, **kw):
        if self.mesh is None:  # one level: every peer counts as remote
            return reduce_scatter(output, input, group, spec=self.inter, **kw)
        return hierarchical_reduce_scatter(
            output,
            input,
            mesh=self.mesh,
            group=group,  # the caller's flat layout: chunk j for its group's rank j
            intra_spec=self.intra,
            inter_spec=self.inter,
            **kw,
        )

    def reduce_scatter_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        if self.mesh is None:
            return reduce_scatter_wire_bytes(
                numel, world_size, self.inter, split=split, element_size=element_size
            )
        return hierarchical_reduce_scatter_wire_bytes(
            numel,
            self.mesh.size(0),
            self.mesh.size(1),
            self.intra,
            self.inter,
            split=split,
            element_size=element_size,
        )


@dataclass(frozen=True, kw_only=True)
class IntegerReduce(ReducePlan):
    """Global-QSGD: integer codes on a global scale, summed by the backend's plain SUM."""

    carrier: str = "int8"
    group_size: int = 128
    rounding: Rounding = Rounding.STOCHASTIC
    nonfinite: str = "raise"
    """``"propagate"`` when the caller checks NaN/Inf itself (the FSDP and DDP hooks)."""

    def _options(self) -> dict:
        return dict(
            carrier=self.carrier,
            group_size=self.group_size,
            rounding=self.rounding,
            nonfinite=self.nonfinite,
        )

    def reduce_scatter(self, output, input, group, **kw):
        kw.pop("backend", None)  # the integer encode picks its own kernel
        return integer_reduce_scatter(output, input, group, **self._options(), **kw)

    def all_reduce(self, tensor, group, **kw):
        kw.pop("backend", None)
        return integer_all_reduce(tensor, group, **self._options(), **kw)

    def reduce_scatter_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        return integer_reduce_scatter_wire_bytes(
            numel,
            world_size,
            carrier=self.carrier,
            group_size=self.group_size,
            split=split,
            element_size=element_size,
        )

    def all_reduce_wire_bytes(self, numel, world_size, *, split=None, element_size=4):
        return integer_all_reduce_wire_bytes(
            numel,
            carrier=self.carrier,
            group_size=self.group_size,
            split=split,
            element_size=element_size,
        )
