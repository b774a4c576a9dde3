"""Helpers for qsdp's tests (and users' own): real multi-process gloo runs, byte counting."""

from .distributed import DistByteCounter, count_dist_bytes, run_distributed

__all__ = ["DistByteCounter", "count_dist_bytes", "run_distributed"]
