"""FSDP2 integration: qsdp's collectives behind ``fully_shard``'s custom-comm hooks."""

from .api import compress_fsdp, fsdp_comm_stats, resync
from .comms import QuantizedAllGather, QuantizedReduceScatter, StepClock, WeightDiffAllGather

__all__ = [
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "StepClock",
    "WeightDiffAllGather",
    "compress_fsdp",
    "fsdp_comm_stats",
    "resync",
]
