"""DDP integration: qsdp's compressed all-reduces as a DDP comm hook (CGX, Global-QSGD)."""

from .api import register
from .hook import DDPCompression

__all__ = ["DDPCompression", "register"]
