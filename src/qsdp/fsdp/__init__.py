"""FSDP2 integration: qsdp's collectives behind ``fully_shard``'s custom-comm hooks."""

from ._gathers import QuantizedAllGather, QuantizedMasterAllGather, WeightDiffAllGather
from ._groups import FSDPGroup, ParamSlot, fsdp_groups
from ._hooks import StepClock
from ._reduce import QuantizedReduceScatter
from ._state import CommState, comm_state, fsdp_comm_stats, resync
from .api import compress_fsdp

__all__ = [
    "CommState",
    "FSDPGroup",
    "ParamSlot",
    "QuantizedAllGather",
    "QuantizedMasterAllGather",
    "QuantizedReduceScatter",
    "StepClock",
    "WeightDiffAllGather",
    "comm_state",
    "compress_fsdp",
    "fsdp_comm_stats",
    "fsdp_groups",
    "resync",
]
