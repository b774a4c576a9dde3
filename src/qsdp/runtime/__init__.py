"""What every integration (FSDP2, HSDP, DDP) needs at run time beside the collectives: the
NaN/Inf verdict decided once per backward, and the gate that bounds staleness 1."""

from .nonfinite import NonfiniteCheck, nonfinite_flags
from .staleness import StalenessGate

__all__ = ["NonfiniteCheck", "StalenessGate", "nonfinite_flags"]
