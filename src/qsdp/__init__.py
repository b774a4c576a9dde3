"""qsdp: compressed communication for sharded and plain data-parallel training on PyTorch.

Importing qsdp imports neither triton nor CUDA: kernels load on first use on a CUDA tensor.
"""

from .config import RECIPES, CompressionConfig, recipe
from .fsdp import compress_fsdp, fsdp_comm_stats
from .quant import Encoded, QuantSpec, decode, encode

__all__ = [
    "RECIPES",
    "CompressionConfig",
    "Encoded",
    "QuantSpec",
    "compress_fsdp",
    "decode",
    "encode",
    "fsdp_comm_stats",
    "recipe",
]
__version__ = "0.1.0"
