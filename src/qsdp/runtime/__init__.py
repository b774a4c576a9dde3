"""What every integration (FSDP2, HSDP, DDP) needs at run time beside the collectives: the
NaN/Inf verdict decided once per backward, staleness 1's gate and weight prediction, and the
check that replicas hold the same bits, and the side streams their communication work runs on."""

from .contracts import FlaggedReduction, LocalGradients, StalenessState, check_contract
from .nonfinite import NonfiniteCheck, nonfinite_flags
from .placement import local_of
from .prediction import WeightPrediction
from .replicas import check_replicas, replica_mismatches
from .staleness import StalenessGate
from .streams import SideStreams, side_group, side_mesh, side_stream, twin_group

__all__ = [
    "FlaggedReduction",
    "LocalGradients",
    "NonfiniteCheck",
    "SideStreams",
    "StalenessGate",
    "StalenessState",
    "WeightPrediction",
    "check_contract",
    "check_replicas",
    "local_of",
    "nonfinite_flags",
    "replica_mismatches",
    "side_group",
    "side_mesh",
    "side_stream",
    "twin_group",
]
