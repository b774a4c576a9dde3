"""When staleness 1 starts: synchronous steps until the gradient norm has settled.

[Note: when staleness 1 starts]
A delayed gradient costs most early in training, while the gradients change fastest: in the
one-pass study (GPT-125M, 356 steps) staleness 1 from the first step ended +1.65% from the
synchronous loss, with the first 150 steps synchronous +0.30-0.37%; on 2 CPU processes (the tiny
GPT of ``qsdp demo``, AdamW at 3e-3, 300 steps) see ``docs/recipes.md``, "Staleness 1". So
``Schedule(staleness=1)`` starts synchronous (``start="auto"``): each backward reduces and
applies its own gradient, and the hooks hand its reduced results to :class:`StaleStart`, which
measures the global gradient norm of every such backward (one float all-reduced when the
backward ends, read on the host one backward later, as the NaN/Inf verdict is). The delayed
schedule starts once the norm has *settled*: the median of the last ``WINDOW`` backwards' norms
is within a factor ``SETTLED`` of the median of the ``WINDOW`` before (medians: a spike of one
step moves neither). Early in training the norm falls (or, under a learning-rate warm-up, rises
and falls) by orders of magnitude, and the criterion holds it synchronous through that; once the
norm only wanders with the mini-batch noise, the delayed schedule starts. Every rank of the
group the norm is summed over (the reductions' own: FSDP2's shard group, DDP's group) reads the
same norms and decides alike, so they start at the same backward. Never over the world
([Note: agreement over the model's groups] in ``agreement.py``): so under tensor parallelism
each TP rank's data-parallel group, and each pipeline stage, decides from its own parameters'
norm and may start a backward or two apart from the others (the weights of one forward then
differ in age by a step until both have started). Agreeing over those dimensions too is not
done yet.

The backward that starts the delayed schedule applies nothing (``applied_nothing``: skip its
``optimizer.step()``, as after a drain); each gradient is still applied exactly once, in order.
``start=k`` (an int) starts at the ``k``-th backward without measuring (``0``: the first, the
delayed schedule from the start, as before 2026-11-27); a checkpoint keeps where it stands.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["SETTLED", "WINDOW", "StaleStart"]

#: Backwards per median window of the ``"auto"`` start.
WINDOW = 10
#: The largest ratio between the two windows' medians (either way) at which the norm is settled.
SETTLED = 1.25


class StaleStart:
    """Counts the synchronous backwards before staleness 1 starts and decides when it does
    ([Note: when staleness 1 starts]).

    Args:
        start: ``"auto"`` (when the gradient norm has settled) or the backward to start at.
    """

    def __init__(self, start: int | str = "auto") -> None:
        if start != "auto" and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
            raise ValueError(
                f"Schedule.start={start!r} must be 'auto' (synchronous until the gradient norm "
                "settles) or the number of synchronous steps first (0: delayed from the start)"
            )
        self.start = start
        self.started = start == 0
        """Whether the delayed schedule runs (from the next backward on)."""
        self.backwards = 0
        """Synchronous backwards seen so far."""
        self.started_at: int | None = 0 if self.started else None
        """The number of synchronous backwards before the delayed schedule started."""
        self.norms: list[float] = []
        """The global gradient norms of the synchronous backwards, as read (``"auto"``)."""
        self._parts: list[torch.Tensor] = []
        self._group: dist.ProcessGroup | None = None
        self._queued = -1
        self._inflight: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def observe(
        self,
        result: torch.Tensor | torch.futures.Future | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        """A hook's synchronous result in a backward before the delayed schedule started (a
        reduced gradient, the same on the ranks that replicate it; a future of it under DDP on
        gloo, complete when the backward ends); ``group``: the ranks over which the results
        add up to the whole gradient (FSDP2's shards; a DDP replica holds it all). The
        backward is counted, and under ``"auto"`` measured, when it ends."""
        if self.started:
            return
        if self.start == "auto" and result is not None:
            # a tensor's norm at once, on the hook's stream (nothing of it held to the end)
            if isinstance(result, torch.Tensor):
                result = torch.linalg.vector_norm(result.reshape(-1), dtype=torch.float32)
            self._parts.append(result)
            if self._group is None:
                self._group = group
        task = torch._C._current_graph_task_id()
        if task == -1:
            raise RuntimeError(
                "qsdp staleness 1: a reduction outside a backward; the hooks run in one"
            )
        if task != self._queued:
            self._queued = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """When a backward before the start ends: count it; under ``"auto"`` read the previous
        one's norm (complete long ago), decide, and start this one's all-reduce and its copy
        to the host."""
        self._queued = -1
        self.backwards += 1
        parts, self._parts = self._parts, []
        if self.start != "auto":
            if self.backwards >= self.start:
                self._start()
            return
        if self._inflight is not None:
            host, event = self._inflight
            if event is not None:
                event.synchronize()
            self.norms.append(float(host.sqrt()))
            self._inflight = None
            if _settled(self.norms):
                self._start()
                return
        if not parts:
            return
        norms = []
        for part in parts:
            if not isinstance(part, torch.Tensor):  # a future (DDP on gloo): complete by now
                part = torch.linalg.vector_norm(part.wait().reshape(-1), dtype=torch.float32)
            elif part.is_cuda:  # made on a hook's stream, which the current one waited for
                part.record_stream(torch.cuda.current_stream(part.device))
            norms.append(part)
        total = torch.stack(norms).square().sum().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(total, group=self._group)
        if total.is_cuda:
            host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            host.copy_(total, non_blocking=True)
            self._inflight = (host, torch.cuda.current_stream(total.device).record_event())
        else:
            self._inflight = (total.clone(), None)

    def _start(self) -> None:
        self.started = True
        self.started_at = self.backwards
        self._parts, self._inflight = [], None

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Where the start stands: the backwards seen, when it started (-1: not yet), the last
        two windows' norms (NaN where fewer were read)."""
        last = self.norms[-2 * WINDOW :]
        norms = torch.full((2 * WINDOW,), float("nan"), dtype=torch.float64)
        if last:
            norms[-len(last) :] = torch.tensor(last, dtype=torch.float64)
        return {
            "backwards": torch.tensor([self.backwards]),
            "started_at": torch.tensor([-1 if self.started_at is None else self.started_at]),
            "norms": norms,
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (the norm of the backward that was in flight is lost:
        the next window starts one backward later)."""
        self.backwards = int(state["backwards"])
        at = int(state["started_at"])
        self.started, self.started_at = at >= 0, (at if at >= 0 else None)
        self.norms = [float(v) for v in state["norms"] if not torch.isnan(v)]
        self._parts, self._inflight, self._queued = [], None, -1


def _settled(norms: list[float]) -> bool:
    """Whether the last ``WINDOW`` norms' median is within ``SETTLED`` of the ``WINDOW``
    before's (all finite)."""
    if len(norms) < 2 * WINDOW:
        return False
    last = statistics.median(norms[-WINDOW:])
    before = statistics.median(norms[-2 * WINDOW : -WINDOW])
    if not (0 < last < float("inf") and 0 < before < float("inf")):
        return False
    return max(last / before, before / last) <= SETTLED
