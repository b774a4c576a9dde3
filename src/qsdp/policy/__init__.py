"""Which tensors qsdp compresses (per-parameter filters; adaptive widths come later)."""

from .params import ParamPolicy

__all__ = ["ParamPolicy"]
