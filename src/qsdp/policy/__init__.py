"""Which tensors qsdp compresses, and at how many bits: per-parameter filters, and the
adaptive-width knapsack (``adaptive``; not yet wired into the hooks)."""

from .adaptive import WidthPlan, choose_widths, measure_errors
from .auto import decision_record
from .params import ParamPolicy

__all__ = ["ParamPolicy", "WidthPlan", "choose_widths", "decision_record", "measure_errors"]
