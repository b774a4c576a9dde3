"""qsdp: compressed communication for sharded and plain data-parallel training on PyTorch.

Importing qsdp imports neither triton nor CUDA: kernels load on first use on a CUDA tensor.
"""

from .quant import Encoded, QuantSpec, decode, encode

__all__ = ["Encoded", "QuantSpec", "decode", "encode"]
__version__ = "0.1.0"
