"""qsdp: compressed communication for sharded and plain data-parallel training on PyTorch.

Importing qsdp imports neither triton nor CUDA: kernels load on first use on a CUDA tensor.
"""

from . import ddp
from .config import (
    RECIPES,
    AdaptiveWidths,
    CompressionConfig,
    IntegerGrads,
    NonFinite,
    QuantizedGrads,
    QuantizedMaster,
    QuantizedWeights,
    Schedule,
    TwoLevelGrads,
    WeightDiffs,
    recipe,
)
from .fsdp import compress_fsdp, fsdp_comm_stats
from .quant import Encoded, QuantSpec, decode, encode
from .runtime import StalenessGate, WeightPrediction

__all__ = [
    "RECIPES",
    "AdaptiveWidths",
    "CompressionConfig",
    "Encoded",
    "IntegerGrads",
    "NonFinite",
    "QuantSpec",
    "QuantizedGrads",
    "QuantizedMaster",
    "QuantizedWeights",
    "Schedule",
    "StalenessGate",
    "TwoLevelGrads",
    "WeightDiffs",
    "WeightPrediction",
    "compress_fsdp",
    "ddp",
    "decode",
    "encode",
    "fsdp_comm_stats",
    "recipe",
]
__version__ = "0.1.0"
