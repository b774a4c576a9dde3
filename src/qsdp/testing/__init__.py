"""Helpers for qsdp's tests (and users' own): real multi-process gloo runs, byte counting,
deterministic per-rank inputs and quantization error bounds."""

from .bounds import assert_within, dtype_slack, quant_steps, rounding_bound, to_quant_domain
from .distributed import (
    DistByteCounter,
    assert_replicas_agree,
    assert_same_on_all_ranks,
    count_dist_bytes,
    preload,
    rank_tensor,
    run_distributed,
)

__all__ = [
    "DistByteCounter",
    "assert_replicas_agree",
    "assert_same_on_all_ranks",
    "assert_within",
    "count_dist_bytes",
    "dtype_slack",
    "preload",
    "quant_steps",
    "rank_tensor",
    "rounding_bound",
    "run_distributed",
    "to_quant_domain",
]
