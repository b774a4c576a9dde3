"""Staleness 1 for FSDP2's gradient hooks: each reduction is applied one step late.

[Note: staleness 1 in FSDP2]
With ``Schedule(staleness=1)`` the reduce-scatter hook (and, for compressed HSDP, the
replicate all-reduce hook) of every FSDP group does, when FSDP2 calls it in step ``t``'s backward:

1. *apply*: write the result of step ``t - 1``'s reduction of this group into FSDP2's output
   (zeros in the first step, and after :meth:`Pipeline.drain`), so FSDP2 puts it into the
   sharded ``.grad`` as it would its own; NaN/Inf is checked here, on the gradient the step
   applies (per parameter, agreed over the hook's group, decided when the backward ends);
2. *send*: start the reduction of step ``t``'s gradient on a stream of its own and on a second
   communicator (a twin of each process group, made at installation): on one communicator NCCL
   runs collectives in issue order, so the reduction would queue in front of step ``t + 1``'s
   weight all-gathers instead of sharing the link with them in the other direction.

FSDP2 hands the hook a freshly allocated input buffer; the hook reduces it in place of a copy and
marks it as used by its own stream (``record_stream``), so the caching allocator reuses that
memory only after the reduction is done, early in step ``t + 1``'s forward. The memory cost is
those buffers while their reductions run, and one result shard per group (reduce dtype). The
noise keys are those of the synchronous schedule, so staleness 1 applies exactly the gradients
staleness 0 would have reduced, one step late (tested against the delay done by hand).

With gradient accumulation the hook must run once per step: synchronise only the last
micro-batch (``set_requires_gradient_sync(False)`` before the others, as ``qsdp train`` does).
After the last backward, :meth:`Pipeline.drain` puts the reductions still in flight into
``.grad`` for one more ``optimizer.step()``. A step that applied nothing (the first, or the one
after a drain) is reported by :attr:`Pipeline.applied_nothing`: skip its ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..runtime.placement import like_param, local_of
from ..runtime.streams import SideStreams, twin_group

__all__ = ["Delay", "DelayedHook", "Pipeline", "twin_groups"]


class DelayedHook(Protocol):
    """What :class:`Pipeline` asks of a gradient hook at staleness 1."""

    delay: Delay
    """Its reduction in flight."""

    def check_applied(self, flat: torch.Tensor) -> None:
        """Zero ``flat`` on every rank if any rank's holds NaN/Inf (outside a backward)."""


def twin_groups(groups: list[dist.ProcessGroup]) -> dict[str, dist.ProcessGroup]:
    """A second communicator over the same ranks for each of ``groups``, by group name: the
    process's :func:`qsdp.runtime.twin_group` of those ranks ([Note: qsdp's own
    communicators]), made in sorted order, by their members only."""
    ranks = {g.group_name: tuple(dist.get_process_group_ranks(g)) for g in groups}
    made = {r: twin_group(list(r)) for r in sorted(set(ranks.values()))}
    return {name: made[r] for name, r in ranks.items()}


class Delay:
    """One hook's reduction in flight: its result buffer and (on CUDA) the event that marks
    its end on the stream it runs on, the ``index``-th of ``streams`` (the pipeline's two side
    streams, alternating between the hooks: [Note: side streams from the high-priority pool])."""

    def __init__(self, streams: SideStreams, index: int) -> None:
        self.result: torch.Tensor | None = None
        """The last reduction's result, or None: nothing in flight."""
        self._event: torch.cuda.Event | None = None
        self._event_device: torch.device | None = None
        self._streams, self._index = streams, index
        self._stream: torch.cuda.Stream | None = None
        self.op: str = "avg"
        self.local: torch.Tensor | None = None
        """This rank's own share of the gradient in flight (its row of the unreduced input, or,
        from a two-level reduction, its chunk averaged over the node: :meth:`set_local`), kept
        when the pipeline keeps local estimates ([Note: weight prediction]). Read it through
        :meth:`local_estimate`."""
        self._local_event: torch.cuda.Event | None = None

    def finish(self) -> torch.Tensor | None:
        """The result, complete for the current stream (on CUDA the stream waits; the host
        does not), or None."""
        if self._event is not None:
            torch.cuda.current_stream(self._event_device).wait_event(self._event)
            self._event = None
        return self.result

    def local_estimate(self) -> torch.Tensor | None:
        """:attr:`local`, complete for the current stream (on CUDA it waits for the hook's
        stream to have written it, not for the rest of the reduction)."""
        if self._local_event is not None:
            torch.cuda.current_stream(self._event_device).wait_event(self._local_event)
            self._local_event = None
        return self.local

    def set_local(self, estimate: torch.Tensor) -> None:
        """The reduction's ``node_average`` callback: keep ``estimate`` (in the result's dtype,
        as the own row would be) as :attr:`local`. Called inside :meth:`send`'s ``launch``, on
        the hook's stream on CUDA: an event marks where it is written. (Its memory comes from
        that stream; the compute stream's reads of it are issued before the next ``send``,
        whose stream first waits for the compute stream, so it is not reused early.)"""
        self.local = estimate.to(self.result.dtype).view(self.result.shape)
        if estimate.is_cuda:
            self._local_event = torch.cuda.current_stream(estimate.device).record_event()

    def send(
        self,
        launch: Callable[[torch.Tensor], object],
        *,
        like: torch.Tensor,
        input: torch.Tensor,
        local: torch.Tensor | None = None,
    ) -> None:
        """Start ``launch(result)`` (the plan's collective writing ``result``, shaped as
        ``like``) after everything the current stream did. ``input`` (what the collective
        reads) is marked as used by the hook's stream, so the caching allocator hands its
        memory out again only once that stream has passed the reduction: the hook keeps no
        reference, and FSDP2's buffer is freed as soon as the reduction is done. ``local``:
        this rank's share of it, copied (on the current stream) as :attr:`local` (or None:
        ``launch`` may give one by :meth:`set_local`)."""
        self.local = None if local is None else local.clone()
        self._local_event = None
        if (
            self.result is None
            or self.result.shape != like.shape
            or self.result.dtype != like.dtype
        ):
            self.result = torch.empty_like(like)
            if like.is_cuda and self._stream is not None:
                self.result.record_stream(self._stream)
        if not like.is_cuda:
            launch(self.result)  # gloo: synchronous, applied one step late all the same
            return
        if self._stream is None:
            self._stream = self._streams.get(like.device, self._index)
            self.result.record_stream(self._stream)
        # the caching allocator must not hand FSDP2's buffer out again before this stream read it
        input.record_stream(self._stream)
        self._stream.wait_stream(torch.cuda.current_stream(like.device))
        with torch.cuda.stream(self._stream):
            launch(self.result)
            self._event = self._stream.record_event()
        self._event_device = like.device

    def clear(self) -> None:
        self.finish()  # (the whole reduction: the estimate's write is before its end)
        self._local_event = None
        self.result = None
        self.local = None


class Pipeline:
    """Staleness 1 of one model: every gradient hook's :class:`Delay`, the parameters each
    result belongs to, and the state a checkpoint keeps. See [Note: staleness 1 in FSDP2]."""

    def __init__(self) -> None:
        self.streams = SideStreams(2)
        """The side streams every delayed reduction runs on, two per device, alternating."""
        self._delays = 0
        self.entries: list[tuple[DelayedHook, list[tuple[nn.Parameter, int]]]] = []
        """(hook, [(parameter, padded elements in the hook's flat shard)]) per hook."""
        self.applied_nothing = True
        """Whether the last backward's hooks applied no reduction (the first step, or the one
        after a drain): skip that step's ``optimizer.step()``."""
        self.synchronous = False
        """Set by ``CommState.synchronous()``: the hooks reduce and apply at once."""
        self.keep_local = False
        """The hooks keep each rank's own share of the gradient in flight
        (:meth:`keep_local_gradients`)."""

    def check_synchronous(self, hook: DelayedHook) -> None:
        """A synchronous backward with this hook's reduction still in flight would drop it."""
        if hook.delay.result is not None:
            raise RuntimeError(
                "qsdp staleness 1: a synchronous backward while a reduction is in flight would "
                "lose it; call drain() (and optimizer.step()) before synchronous()"
            )
        self.applied_nothing = False

    @property
    def in_flight(self) -> bool:
        """A reduction is in flight: the next backward applies it."""
        return any(hook.delay.result is not None for hook, _ in self.entries)

    def new_delay(self) -> Delay:
        """A hook's :class:`Delay`, on the next of :attr:`streams` in turn."""
        self._delays += 1
        return Delay(self.streams, self._delays - 1)

    def add(self, hook: DelayedHook, params: list[tuple[nn.Parameter, int]]) -> None:
        self.entries.append((hook, params))

    def keep_local_gradients(self) -> None:
        """From the next backward on, each delayed reduction keeps this rank's own share of its
        input (one shard per group, in the reduce dtype), for :meth:`local_gradients`: a
        reduce-scatter its row of the unreduced input (over two levels: its chunk averaged over
        the node, handed over by the reduction), HSDP's replicate all-reduce the node's
        average (only the slow inter-node reduction is delayed)."""
        if not self.entries:
            raise ValueError("local gradient estimates: this model has no delayed reduction")
        self.keep_local = True

    def estimate_group(self) -> dist.ProcessGroup | None:
        """Where the local estimates together make one estimate of the whole gradient: the
        node (the shard group) under compressed HSDP, each node having its own; else the
        world (None), whose ranks each hold one shard of it."""
        groups = {id(h.shard): h.shard for h, _ in self.entries if hasattr(h, "replicate")}
        if len(groups) > 1:
            raise ValueError("local gradient estimates: the HSDP hooks shard over different groups")
        return next(iter(groups.values()), None)

    def local_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's share of this rank's own gradient of the step in flight, shaped as
        its local shard (an unbiased estimate of the averaged gradient the next backward
        applies); empty when nothing is in flight."""
        out: dict[nn.Parameter, torch.Tensor] = {}
        for hook, params in self.entries:
            delay: Delay = hook.delay
            local = delay.local_estimate()
            if local is not None:
                _check_avg(delay, "local gradient estimates need it")
                out.update(_by_param(local, params))
        return out

    def drain(self) -> None:
        """After the last backward: wait for every reduction in flight and put it into the
        parameters' ``.grad`` (then call ``optimizer.step()`` once more). NaN/Inf is checked
        as for every applied gradient (raised on every rank). A no-op when nothing is in flight.
        Call on every rank."""
        for hook, params in self.entries:
            delay: Delay = hook.delay
            result = delay.finish()
            if result is None:
                continue
            _check_avg(delay, "qsdp staleness 1 cannot drain it")
            hook.check_applied(result)
            for p, view in _by_param(result, params).items():
                grad = view.to(p.dtype)
                if p.grad is None:
                    p.grad = like_param(grad.clone(), p)
                else:
                    local_of(p.grad).copy_(grad)
            delay.clear()
        self.applied_nothing = True

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The results in flight, each as a DTensor sharded over its parameters' mesh (each
        rank holds its own shard), zeros where none is."""
        out: dict[str, torch.Tensor] = {
            "pending": torch.tensor([int(any(h.delay.result is not None for h, _ in self.entries))])
        }
        for i, (hook, params) in enumerate(self.entries):
            out[f"pending.{i}"] = _saved(hook.delay.finish(), params)
            if self.keep_local:  # this rank's share of it, for weight prediction
                out[_local_key(i, hook)] = _saved(hook.delay.local_estimate(), params)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pending = int(state["pending"])
        for i, (hook, params) in enumerate(self.entries):
            hook.delay.clear()
            if pending:
                value = state[f"pending.{i}"]
                local = local_of(value)
                hook.delay.result = local.to(_device(params)).clone()
                if self.keep_local:
                    mine = local_of(state[_local_key(i, hook)])
                    hook.delay.local = mine.to(_device(params), hook.delay.result.dtype).clone()
        self.applied_nothing = not pending


def _local_key(i: int, hook: DelayedHook) -> str:
    """The checkpoint key of entry ``i``'s local estimate. Under compressed HSDP it is the
    node's average, which differs between the replicas of a shard, so each replica saves its
    own (``local.{i}.replica{r}``); a reduce-scatter's estimates are one shard per rank."""
    replicate = getattr(hook, "replicate", None)
    if replicate is None:
        return f"local.{i}"
    return f"local.{i}.replica{dist.get_rank(replicate)}"


def _check_avg(delay: Delay, what: str) -> None:
    """A result or estimate is the average only under FSDP2's AVG: FSDP2 divides the others
    itself, with factors qsdp does not see."""
    if delay.op != "avg":
        raise ValueError(
            f"FSDP2 ran this reduction with op {delay.op!r}, not AVG; {what}: use a float32 or "
            "bfloat16 reduce_dtype, and no set_gradient_divide_factor"
        )


def _by_param(flat: torch.Tensor, params: list[tuple[nn.Parameter, int]]) -> dict:
    """A group's flat shard (each parameter padded to its slot) as one view per parameter,
    shaped as the parameter's local shard."""
    views, offset = {}, 0
    for p, padded in params:
        local = local_of(p)
        views[p] = flat[offset : offset + local.numel()].view(local.shape)
        offset += padded
    return views


def _saved(flat: torch.Tensor | None, params: list[tuple[nn.Parameter, int]]) -> torch.Tensor:
    """A group's flat shard for a checkpoint (fp32, sharded like the parameters), zeros where
    there is none."""
    local = (
        flat.detach().float().clone()
        if flat is not None
        else torch.zeros(sum(n for _, n in params), device=_device(params))
    )
    return _sharded(local, params)


def _device(params: list[tuple[nn.Parameter, int]]) -> torch.device:
    p = params[0][0]
    return local_of(p).device


def _sharded(local: torch.Tensor, params: list[tuple[nn.Parameter, int]]) -> torch.Tensor:
    """``local`` (this rank's flat shard) as a 1-D DTensor sharded like the parameters."""
    p = params[0][0]
    if not isinstance(p, DTensor):
        return local
    mesh = p.device_mesh
    placements = [Shard(0) if isinstance(pl, Shard) else pl for pl in p.placements]
    shards = 1
    for dim, pl in enumerate(placements):
        if isinstance(pl, Shard):
            shards *= mesh.size(dim)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size([local.numel() * shards]),
        stride=(1,),
    )
