"""Which tensors qsdp compresses, and at how many bits: per-parameter filters, and the
adaptive-width knapsack (``adaptive``; not yet wired into the hooks)."""

from .adaptive import WidthPlan, choose_widths, measure_errors
from .params import ParamPolicy

__all__ = ["ParamPolicy", "WidthPlan", "choose_widths", "measure_errors"]
