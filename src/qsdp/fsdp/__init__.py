"""FSDP2 integration: qsdp's collectives behind ``fully_shard``'s custom-comm hooks."""

from .api import CommState, comm_state, compress_fsdp, fsdp_comm_stats, resync
from .comms import QuantizedAllGather, QuantizedReduceScatter, StepClock, WeightDiffAllGather

__all__ = [
    "CommState",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "StepClock",
    "WeightDiffAllGather",
    "comm_state",
    "compress_fsdp",
    "fsdp_comm_stats",
    "resync",
]
