"""FSDP2 integration: qsdp's collectives behind ``fully_shard``'s custom-comm hooks."""

from .api import compress_fsdp, fsdp_comm_stats
from .comms import QuantizedAllGather, QuantizedReduceScatter

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "compress_fsdp", "fsdp_comm_stats"]
