"""Bytes that qsdp's collectives hand to ``torch.distributed``: a small, resettable counter.

[Note: one convention for bytes]
A rank's bytes are the data it hands to ``torch.distributed`` that some peer needs, each byte
counted once, whatever algorithm the backend then runs:

- all-gather: the rank's own shard (it reaches every peer, counted once);
- reduce-scatter (``all_to_all_single`` with an empty own split, or ``reduce_scatter_tensor``):
  the ``n - 1`` chunks bound for the peers; the own chunk never leaves the rank;
- all-reduce: the whole tensor (a reduce-scatter plus an all-gather: ``(n - 1) / n + 1 / n``);
- every side channel the same way: scale all-reduces, NaN/Inf verdicts (``"nonfinite_check"``),
  the raw part of a policy split, FSDP2's own HSDP replicate all-reduce
  (``"all_reduce_replicate"``, counted by ``compress_fsdp``).

The uncompressed reference of the trainer (``qsdp.train``) is measured by the same rule, so a
compression ratio compares like with like. Every collective in :mod:`qsdp.comm` records under
its own name; metrics code reads :data:`comm_stats` (the default counter) or a
:class:`CommStats` of its own passed as ``stats=`` to a collective.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["CollectiveCounts", "CommStats", "comm_stats"]


@dataclass(frozen=True)
class CollectiveCounts:
    """Totals of one collective since the counter was last reset."""

    calls: int = 0
    """Calls of the qsdp collective."""
    bytes: int = 0
    """Bytes of the send tensors handed to ``torch.distributed``."""
    dist_calls: int = 0
    """``torch.distributed`` calls the collective made (scales all-reduce included)."""


class CommStats:
    """Per-collective byte and call counts, safe to share between threads.

    Example::

        stats = CommStats()
        all_gather(out, shard, spec=spec, stats=stats)
        stats["all_gather"].bytes  # == all_gather_wire_bytes(shard.numel(), spec)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        """``[calls, bytes, dist_calls]`` per collective, updated in place (a hot path counts
        several times per call: no object made per count)."""

    def count_call(self, collective: str) -> None:
        """Count one call of ``collective`` (done once per qsdp collective call)."""
        with self._lock:
            c = self._counts.get(collective)
            if c is None:
                c = self._counts[collective] = [0, 0, 0]
            c[0] += 1

    def add_bytes(self, collective: str, nbytes: int) -> None:
        """Count one ``torch.distributed`` call of ``collective`` sending ``nbytes``."""
        with self._lock:
            c = self._counts.get(collective)
            if c is None:
                c = self._counts[collective] = [0, 0, 0]
            c[1] += nbytes
            c[2] += 1

    def __getitem__(self, collective: str) -> CollectiveCounts:
        with self._lock:
            return CollectiveCounts(*self._counts.get(collective, (0, 0, 0)))

    def snapshot(self) -> dict[str, CollectiveCounts]:
        """A copy of all counts, keyed by collective name."""
        with self._lock:
            return {k: CollectiveCounts(*c) for k, c in self._counts.items()}

    @property
    def total_bytes(self) -> int:
        """Bytes over all collectives."""
        with self._lock:
            return sum(c[1] for c in self._counts.values())

    def reset(self) -> None:
        """Forget all counts."""
        with self._lock:
            self._counts.clear()

    def __repr__(self) -> str:
        return f"CommStats({self.snapshot()})"


#: The counter every collective records into unless given ``stats=``.
comm_stats = CommStats()
