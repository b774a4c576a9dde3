"""Compressed collectives on ``torch.distributed`` (gloo on CPU, NCCL on GPU), one per module.

Every collective quantizes with :mod:`qsdp.quant`, hands only bytes (or integer carriers) to
``torch.distributed``, counts them in :data:`comm_stats` (or the ``stats=`` given), works for any
world size and tensor length, and returns a :class:`CommWork` for ``async_op=True``.
"""

from ._all_gather import all_gather, all_gather_payloads, all_gather_wire_bytes
from ._common import CommWork, noise_rank, noise_stream, replica_seed
from ._dist import dist_all_gather, group_device
from ._graphs import CodecGraphs
from ._hierarchical import hierarchical_reduce_scatter, hierarchical_reduce_scatter_wire_bytes
from ._integer import (
    integer_all_reduce,
    integer_all_reduce_wire_bytes,
    integer_reduce_scatter,
    integer_reduce_scatter_wire_bytes,
)
from ._plans import IntegerReduce, PlainReduce, QuantizedReduce, ReducePlan, TwoLevelReduce
from ._reduce_scatter import reduce_scatter, reduce_scatter_wire_bytes
from ._split import Split, fused_row
from ._stats import CollectiveCounts, CommStats, comm_stats
from ._two_phase import two_phase_all_reduce, two_phase_all_reduce_wire_bytes
from ._weight_diff import all_gather_diff, all_gather_diff_wire_bytes

__all__ = [
    "CodecGraphs",
    "CollectiveCounts",
    "CommStats",
    "CommWork",
    "IntegerReduce",
    "PlainReduce",
    "QuantizedReduce",
    "ReducePlan",
    "Split",
    "TwoLevelReduce",
    "all_gather",
    "all_gather_diff",
    "all_gather_diff_wire_bytes",
    "all_gather_payloads",
    "all_gather_wire_bytes",
    "comm_stats",
    "dist_all_gather",
    "group_device",
    "fused_row",
    "hierarchical_reduce_scatter",
    "hierarchical_reduce_scatter_wire_bytes",
    "integer_all_reduce",
    "integer_all_reduce_wire_bytes",
    "integer_reduce_scatter",
    "integer_reduce_scatter_wire_bytes",
    "noise_rank",
    "noise_stream",
    "replica_seed",
    "reduce_scatter",
    "reduce_scatter_wire_bytes",
    "two_phase_all_reduce",
    "two_phase_all_reduce_wire_bytes",
]
