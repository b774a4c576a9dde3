"""Which tensors qsdp compresses, and at how many bits: per-parameter filters, the
adaptive-width knapsack (``adaptive``; not yet wired into the hooks), and ``"auto"``'s measured
choice of a recipe (``auto``: :class:`AutoDecision`)."""

from .adaptive import WidthPlan, choose_widths, measure_errors
from .auto import AutoDecision
from .params import ParamPolicy

__all__ = ["AutoDecision", "ParamPolicy", "WidthPlan", "choose_widths", "measure_errors"]
