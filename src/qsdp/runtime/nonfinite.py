"""The NaN/Inf gradient check of a model's compressed reduce-scatters, decided once per backward.

[Note: one host sync per backward]
Each reduce-scatter computes per-parameter NaN/Inf flags of its input on the device and
all-reduces them (MAX), so every rank holds the same flags, and zeroes its output where a flag
is set (a NaN never reaches the optimizer). Reading the flags on the host inside the hook would
stall the CPU once per FSDP group (25 times a step for a 24-block GPT), and with it the overlap
of communication and compute. Instead the flags wait on the device, and one autograd final
callback, queued by the first reduce-scatter of a backward, reads them all at once when the
backward ends: it raises naming every affected parameter (``nonfinite="raise"``) or counts
the zeroed groups (``"zero"``) before the optimizer can step. A reduce-scatter outside a backward
(a direct call) decides at once.
"""

from __future__ import annotations

import torch

__all__ = ["NonfiniteCheck", "nonfinite_flags"]


def nonfinite_flags(
    chunks: torch.Tensor, layout: list[tuple[str, int]] | None, limit: float = float("inf")
) -> torch.Tensor:
    """Per-parameter flags (int32) of NaN/Inf, or of ``|x| > limit`` (a value the quantizer
    would send as NaN, ``ReducePlan.value_limit``), in the rank-major ``[world, M]`` gradient
    input (one flag for the whole group when the layout does not match)."""
    if limit == float("inf"):
        bad = (~torch.isfinite(chunks)).any(dim=0)
    else:
        bad = (~(chunks.abs() <= limit)).any(dim=0)  # NaN compares false: flagged too
    if layout is None or sum(n for _, n in layout) != bad.numel():
        return bad.any().reshape(1).to(torch.int32)
    segments = torch.split(bad, [n for _, n in layout])
    return torch.stack([seg.any() for seg in segments]).to(torch.int32)


def _graph_task() -> int:
    """The running backward's id, -1 outside a backward."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if task is None else task()


class NonfiniteCheck:
    """Flags of one model's reduce-scatters, decided at the end of each backward."""

    def __init__(self, mode: str) -> None:
        if mode not in ("raise", "zero"):
            raise ValueError(f"NonfiniteCheck mode must be 'raise' or 'zero', got {mode!r}")
        self.mode = mode
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._ready: list[torch.futures.Future] = []
        self._queued = -1  # the backward whose final callback is queued, -1 for none

    def add(
        self, hook: object, flags: torch.Tensor, *, ready: torch.futures.Future | None = None
    ) -> None:
        """Record a reduction's flags, the same on every rank; ``hook`` has ``layout``,
        ``module_name`` and a ``zeroed`` counter. ``ready``: a future to wait for before the
        flags are read (DDP fills them in its communication's callback)."""
        task = _graph_task()
        if task != -1 and task == self._queued:
            self._pending.append((hook, flags))
            self._ready.extend([ready] if ready is not None else [])
            return
        # a new backward (flags left by one that failed before its end are dropped), or none
        self._pending = [(hook, flags)]
        self._ready = [ready] if ready is not None else []
        if task == -1:
            self.decide()
        else:
            torch.autograd.Variable._execution_engine.queue_callback(self.decide)
            self._queued = task

    def decide(self) -> None:
        """Read the pending flags (one host sync): raise or count."""
        self._queued = -1
        pending, self._pending = self._pending, []
        ready, self._ready = self._ready, []
        for fut in ready:  # every collective of the backward was issued before this runs
            fut.wait()
        if not pending:
            return
        host = torch.cat([f.reshape(-1) for _, f in pending]).tolist()
        where: list[str] = []
        offset = 0
        for hook, flags in pending:
            mine = host[offset : offset + flags.numel()]
            offset += flags.numel()
            if not any(mine):
                continue
            hook.zeroed += 1
            layout = hook.layout
            if layout is not None and len(layout) == len(mine):
                where += [layout[i][0] for i, bad in enumerate(mine) if bad]
            else:
                where.append(
                    getattr(hook, "where", "")
                    or f"the parameters of FSDP module {hook.module_name or '<root>'}"
                )
        if where and self.mode == "raise":
            raise ValueError(
                f"non-finite gradient (NaN/Inf, or too large to quantize) on at least one rank in "
                f"{', '.join(where)}; fix the source (a diverging loss, a missing grad clip or "
                "loss scale), or build the config with nonfinite='zero' (qsdp.recipe(name, "
                "nonfinite='zero')) to zero them for the step (counted); the gradients of these "
                "groups were zeroed"
            )
