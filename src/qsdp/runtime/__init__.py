"""What every integration (FSDP2, HSDP, DDP) needs at run time beside the collectives: the
NaN/Inf verdict decided once per backward, and staleness 1's gate and weight prediction."""

from .nonfinite import NonfiniteCheck, nonfinite_flags
from .prediction import WeightPrediction
from .staleness import StalenessGate

__all__ = ["NonfiniteCheck", "StalenessGate", "WeightPrediction", "nonfinite_flags"]
