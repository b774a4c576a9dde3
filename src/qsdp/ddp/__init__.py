"""DDP integration: qsdp's compressed all-reduces as a DDP comm hook (CGX, Global-QSGD)."""

from .hook import DDPCompression, register

__all__ = ["DDPCompression", "register"]
