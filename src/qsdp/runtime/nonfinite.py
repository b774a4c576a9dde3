"""The NaN/Inf gradient check of a model's compressed reductions, decided once per backward.

[Note: one host sync per backward]
Each reduction computes per-parameter NaN/Inf flags on the device. Reading them on the host
inside the hook would stall the CPU once per FSDP group (25 times a step for a 24-block GPT),
and with it the overlap of communication and compute. Instead the flags wait on the device, and
one autograd final callback, queued by the first reduction of a backward, reads them all at
once when the backward ends: it raises naming every affected parameter (``nonfinite="raise"``)
or counts the zeroed groups (``"zero"``) before the optimizer can step. A reduction outside a
backward (a direct call) decides at once.

[Note: one flag agreement per backward]
Every rank must reach the same verdict, but an FSDP2 reduce-scatter's flags are of this rank's
input, compressed HSDP's of this rank's shard of the result, and staleness 1's of the result it
applies (outside a backward, ``drain()`` agrees at once). They used to be agreed (a MAX
all-reduce over the shard group) inside each hook: 25 latency-bound collectives a step, each
queued between two modules' exchanges. Now a hook hands its flags over unagreed, with the group
to agree them over and the parameters whose gradients they speak for (``add(..., group=,
params=)``), and the final callback agrees all of a group's flags in one all-reduce, in the
order the hooks ran (the same on every rank of the group), before its one host read. The
zeroing moves with it: where any rank's flag is set, every rank zeroes the module's gradients
when the backward ends (after FSDP2's own final callback, queued first, has written them), not
the reduction's output when it is made. So under ``"zero"`` with FSDP2 reducing every
micro-batch of an accumulation, a NaN zeroes the module's gradient accumulated so far, not only
the micro-batch's share. DDP's flags are of the all-reduced bucket, the same on every rank: they
need no agreement (``ready=``: wait for the bucket's exchange first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

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


class _Entry(NamedTuple):
    """One reduction's flags in a backward: ``groups`` empty when they are agreed already."""

    hook: object
    flags: torch.Tensor
    groups: tuple[dist.ProcessGroup, ...]
    params: tuple[torch.Tensor, ...]


def _agree_deferred(pending: list[_Entry]) -> list[_Entry]:
    """``pending`` with every deferred entry's flags MAX-reduced over its groups, one after the
    other: one all-reduce per group, entries with the same groups together, in the order their
    first entry came (the hooks' order, the same on every rank of a group)."""
    groups: dict[tuple[int, ...], tuple[tuple[dist.ProcessGroup, ...], list[int]]] = {}
    for i, e in enumerate(pending):
        if e.groups:
            groups.setdefault(tuple(map(id, e.groups)), (e.groups, []))[1].append(i)
    out = list(pending)
    for over, idx in groups.values():
        flat = torch.cat([pending[i].flags.reshape(-1) for i in idx])
        for group in over:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        parts = flat.split([pending[i].flags.numel() for i in idx])
        for i, part in zip(idx, parts, strict=True):
            out[i] = pending[i]._replace(flags=part)
    return out


def as_groups(
    group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None,
) -> tuple[dist.ProcessGroup, ...]:
    """``group`` as the tuple of groups flags are agreed over, one after the other (empty for
    None: agreed already)."""
    if group is None:
        return ()
    return (group,) if isinstance(group, dist.ProcessGroup) else tuple(group)


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
        self._pending: list[_Entry] = []
        self._ready: list[torch.futures.Future] = []
        self._queued = -1  # the backward whose final callback is queued, -1 for none

    def add(
        self,
        hook: object,
        flags: torch.Tensor,
        *,
        ready: torch.futures.Future | None = None,
        group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
        params: Sequence[torch.Tensor] = (),
    ) -> None:
        """Record a reduction's flags; ``hook`` has ``layout``, ``module_name`` and a
        ``zeroed`` counter. ``ready``: a future to wait for before the flags are read (DDP fills
        them in its communication's callback). Without ``group`` the flags are the same on every
        rank already; with it they are this rank's, agreed (MAX) over ``group`` (over each of
        a sequence of groups in turn: over all their ranks) when the backward ends, and where
        any is set ``params``' gradients are zeroed then ([Note: one flag agreement per
        backward])."""
        entry = _Entry(hook, flags, as_groups(group), tuple(params))
        task = _graph_task()
        if task != -1 and task == self._queued:
            self._pending.append(entry)
            self._ready.extend([ready] if ready is not None else [])
            return
        # a new backward (flags left by one that failed before its end are dropped), or none
        self._pending = [entry]
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
        pending = _agree_deferred(pending)
        host = torch.cat([e.flags.reshape(-1) for e in pending]).tolist()
        where: list[str] = []
        offset = 0
        for hook, flags, _, params in pending:
            mine = host[offset : offset + flags.numel()]
            offset += flags.numel()
            if not any(mine):
                continue
            hook.zeroed += 1
            for p in params:  # deferred: zeroed here, on every rank (raise: before raising)
                if p.grad is not None:
                    p.grad.zero_()
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
