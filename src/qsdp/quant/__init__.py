"""Quantizers: tensors to wire bytes and back (reference in torch, fused kernels in Triton)."""

from .codec import (
    Backend,
    Encoded,
    decode,
    decode_add,
    decode_rows,
    decode_sum,
    decode_sum_encode,
    decode_sum_finish,
    divide_into,
    encode,
    encode_diff,
    encode_rows,
)
from .flags import flagged_groups, run_flags, zero_flagged, zero_flagged_each
from .global_int import (
    CARRIERS,
    global_int_decode,
    global_int_encode,
    global_int_levels,
    group_absmax,
)
from .rowsum import sum_rows_finish
from .spec import BITS, STEP_FLOOR, NonFinite, QuantSpec, Rounding, Scheme

__all__ = [
    "BITS",
    "CARRIERS",
    "STEP_FLOOR",
    "Backend",
    "Encoded",
    "NonFinite",
    "QuantSpec",
    "Rounding",
    "Scheme",
    "decode",
    "decode_add",
    "decode_rows",
    "decode_sum",
    "decode_sum_encode",
    "decode_sum_finish",
    "divide_into",
    "encode",
    "encode_diff",
    "encode_rows",
    "flagged_groups",
    "global_int_decode",
    "global_int_encode",
    "global_int_levels",
    "group_absmax",
    "run_flags",
    "sum_rows_finish",
    "zero_flagged",
    "zero_flagged_each",
]
