"""qsdp's collectives behind FSDP2's custom all-gather / reduce-scatter protocol.

[Note: what FSDP2 hands us]
``FSDPModule.set_custom_all_gather(comm)`` makes FSDP2 call
``comm(output_tensor=, input_tensor=, group=, async_op=)`` with one flat buffer per parameter
group: ``input_tensor`` is this rank's shard, a view of ``output_tensor`` at ``rank * numel``.
:class:`QuantizedAllGather` encodes the shard, gathers bytes and decodes every shard into
``output_tensor``, the own one included, so all ranks compute on identical weights while the
sharded fp32 master stays exact. ``set_custom_reduce_scatter(comm)`` calls
``comm(output_tensor=, input_tensor=, group=, op=)`` with every gradient of the group laid out
rank-major; FSDP ignores the return value, so :class:`QuantizedReduceScatter` finishes before it
returns (on CUDA the work is enqueued on the current stream, FSDP's reduce-scatter stream). Both
use only these documented hooks; nothing of FSDP's internals is read or patched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .. import comm as qc
from ..quant import QuantSpec

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Counter:
    """Calls so far: the ``step`` of the noise key (every rank makes the same calls in order)."""

    def __init__(self) -> None:
        self.calls = 0

    def next(self) -> int:
        step = self.calls % 2**32
        self.calls += 1
        return step


class QuantizedAllGather(AllGather):
    """FSDP2 all-gather through :func:`qsdp.comm.all_gather`."""

    def __init__(self, spec: QuantSpec, *, seed: int, bucket: int, stats: qc.CommStats) -> None:
        self.spec, self.seed, self.bucket, self.stats = spec, seed, bucket, stats
        self._steps = _Counter()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> qc.CommWork | None:
        if input_tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"qsdp cannot quantize an all-gather of {input_tensor.dtype}: FSDP gathers raw "
                "bytes when a module's parameters mix dtypes; give them one dtype, or leave "
                "that module uncompressed"
            )
        return qc.all_gather(
            output_tensor,
            input_tensor,
            group,
            spec=self.spec,
            async_op=async_op,
            seed=self.seed,
            step=self._steps.next(),
            bucket=self.bucket,
            stats=self.stats,
        )


class QuantizedReduceScatter(ReduceScatter):
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
    ) -> None:
        if (spec is None) == (carrier is None):
            raise ValueError("QuantizedReduceScatter needs exactly one of spec and carrier")
        self.spec, self.carrier, self.group_size = spec, carrier, group_size
        self.seed, self.bucket, self.stats = seed, bucket, stats
        self._steps = _Counter()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
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
                **key,
            )
        else:
            qc.reduce_scatter(output_tensor, input_tensor, group, spec=self.spec, op=op, **key)
        return None
