"""What every integration (FSDP2, HSDP, DDP) needs at run time beside the collectives: the
NaN/Inf verdict decided once per backward."""

from .nonfinite import NonfiniteCheck, nonfinite_flags

__all__ = ["NonfiniteCheck", "nonfinite_flags"]
