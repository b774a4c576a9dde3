"""Staleness 1, once for every integration: the reductions in flight, per parameter.

[Note: one staleness core]
With ``Schedule(staleness=1)`` step ``t`` applies the gradient reduced from step ``t - 1``'s
backward, and the reduction of step ``t``'s own gradient runs while step ``t + 1`` computes (the
elastic-consistency schedule, staleness bounded by one step). Every integration's gradient hook
does the same two things when its framework calls it in step ``t``'s backward:

1. *apply*: :meth:`DelayedReductions.previous` hands it the results of step ``t - 1``'s
   reductions of its parameters, laid out as the framework's buffer (None in the first step and
   after :meth:`DelayedReductions.drain`: the hook applies zeros and the step reports
   ``applied_nothing``); the hook writes them where the framework takes its result from, and
   checks them for NaN/Inf there, as it checks a synchronous result;
2. *send*: :meth:`DelayedReductions.send` starts the reduction of step ``t``'s gradient
   (``launch(result, keep_local)``, the plan's collective on the hook's second communicator)
   after everything the current stream did, on one of two side streams
   ([Note: side streams from the high-priority pool] in ``qsdp.runtime.streams``). A launch may
   return its result's NaN/Inf flags to be agreed when the backward ends ([Note: flags agreed
   where they were reduced]); :meth:`DelayedReductions.agreed_flags` hands them to the hook
   that applies the result.

[Note: flags agreed where they were reduced]
A hook checks the result it applies for NaN/Inf as it checks a synchronous result: flags per
parameter, agreed (MAX) over the ranks when the backward ends, on the current stream. Under
staleness 1 that agreement was the one collective left on the current stream at a backward's
end, issued while the backward's own reductions stream over the same links, and the optimizer
step and the next forward queued behind it (profiled, 2x H200 over sockets, ``sdp4bit``: in two
of six profiled steps the flags' all-reduce held the compute stream 37 and 56 ms, finishing
only as the queued all-to-alls did). A result is complete a step before it is applied, so its
flags can be agreed then: FSDP2's reduce-scatter hook computes them right after its collective,
on the side stream, and its launch returns them (:class:`FlagsToAgree`); when the backward ends,
one all-reduce per communicator agrees all of that backward's flags on a side stream, queued
behind the reductions, and each result's event moves past it. Applying the result, the hook
hands its agreed flags to the check (:meth:`DelayedReductions.agreed_flags`: nothing left to
agree): the same zeroing and the same report, one backward later as before, and no collective
of the flags on the current stream. Results restored from a checkpoint or sent by a backward
that failed before its end, and hooks whose launch returns no flags (DDP's, compressed HSDP's
replicate all-reduce), are checked when applied, as before.

Streams and memory (CUDA). ``send`` marks the input as used by the side stream
(``record_stream``): the caching allocator hands that memory out again only once the side stream
passed the reduction, and the hook keeps no reference. A result is written on the side stream
and an event marks its end; ``previous`` makes the current stream wait for that event (the host
never waits). A hook that copies the previous result out before it sends (FSDP2's
reduce-scatter) reuses its result buffer every step (``reuse=True``: the side stream waits for
the copy before it overwrites it); one that hands the buffer itself to its framework (DDP's
future) gets a new one each step. On gloo the launch is synchronous and applied one step late
all the same.

The noise keys are those of the synchronous schedule, so staleness 1 applies exactly the
gradients staleness 0 would have reduced, one step late (tested against the delay done by hand,
for FSDP2, compressed HSDP and DDP). With gradient accumulation a hook must run once per step:
synchronise only the last micro-batch. A backward under ``synchronous`` (after the staleness
gate drained) reduces and applies at once; with a reduction in flight it would lose it, and
raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from ..quant.codec import cut_runs
from .nonfinite import agree_together
from .placement import like_param, local_of
from .stale_start import StaleStart
from .streams import SideStreams

__all__ = [
    "AppliedCheck",
    "DelayedReductions",
    "FlagsToAgree",
    "Slot",
    "packed_slots",
    "padded_slots",
    "slot_views",
]


class Slot(NamedTuple):
    """Where one parameter's gradient lies in a hook's flat buffer: ``numel`` elements (its
    local tensor's) from ``offset``, shaped ``shape`` (its local tensor's, read once: a
    DTensor's ``to_local()`` costs the host every call)."""

    param: nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's piece of ``flat``, shaped as its local tensor."""
        return flat.view(-1)[self.offset : self.offset + self.numel].view(self.shape)


def padded_slots(params: Iterable[tuple[nn.Parameter, int]]) -> list[Slot]:
    """The slots of a chunk whose parameters are padded: ``(parameter, padded elements)`` in
    chunk order (FSDP2's flat shard)."""
    slots, offset = [], 0
    for p, padded in params:
        local = local_of(p)
        slots.append(Slot(p, offset, local.numel(), tuple(local.shape)))
        offset += padded
    return slots


def slot_views(
    flat: torch.Tensor, slots: Sequence[Slot], *, shaped: bool = True
) -> list[torch.Tensor]:
    """Each of ``slots``' pieces of ``flat`` (shaped as its local tensor with ``shaped``), from
    one ``split`` of ``flat`` where per-slot slicing issued three torch ops a slot (the host's
    cost on a hot path: a GPT block's 12 parameters); the cut is worked out once per layout
    (``qsdp.quant.codec.cut_runs``). Slots out of offset order, or overlapping, are sliced one
    by one."""
    total = flat.numel()
    places = tuple((s.offset, s.numel) for s in slots)
    at = 0
    for offset, numel in places:
        if offset < at:
            return [s.of(flat) if shaped else s.of(flat).view(-1) for s in slots]
        at = offset + numel
    if at > total:
        raise ValueError(f"slots end at element {at} of a buffer of {total}")
    sizes, picks, _ = cut_runs(places, total)
    pieces = flat.view(-1).split(sizes)
    if not shaped:
        return [pieces[i] for i in picks]
    return [pieces[i].view(s.shape) for i, s in zip(picks, slots, strict=True)]


def _waited_views(held: Iterable[tuple[_Local, Slot]]) -> list[tuple[Slot, torch.Tensor]]:
    """Each kept ``(estimate buffer, slot)``'s slot and its view of the buffer, shaped as its
    local tensor, complete for the current stream: each buffer waited for once and its slots
    cut by one split (``slot_views``), not one wait and one slice per parameter (issue 32)."""
    by_buffer: dict[int, tuple[_Local, list[Slot]]] = {}
    for entry, slot in held:
        by_buffer.setdefault(id(entry), (entry, []))[1].append(slot)
    out: list[tuple[Slot, torch.Tensor]] = []
    for entry, slots in by_buffer.values():
        entry.wait()
        out += zip(slots, slot_views(entry.buffer, slots), strict=True)
    return out


def packed_slots(params: Iterable[nn.Parameter]) -> list[Slot]:
    """The slots of a buffer whose parameters follow each other (a DDP bucket)."""
    slots, offset = [], 0
    for p in params:
        slots.append(Slot(p, offset, p.numel(), tuple(p.shape)))
        offset += p.numel()
    return slots


@runtime_checkable
class AppliedCheck(Protocol):
    """What :meth:`DelayedReductions.drain` asks of the hook that sent a reduction."""

    def check_applied(self, flat: torch.Tensor) -> None:
        """Zero ``flat`` (a result about to be applied outside a backward) on every rank if
        any rank's holds NaN/Inf, and report it."""


class FlagsToAgree(NamedTuple):
    """What a launch returns to have its result's NaN/Inf flags agreed when the backward ends
    ([Note: flags agreed where they were reduced])."""

    flags: torch.Tensor
    """This rank's flags of the result, written by the launch (on its stream)."""
    group: dist.ProcessGroup
    """The ranks to agree them over (MAX), the launch's communicator."""


class _InFlight:
    """One reduction in flight: its result buffer and, on CUDA, the event at its end."""

    __slots__ = ("result", "owner", "op", "event", "agreed")

    def __init__(self, result: torch.Tensor, owner: AppliedCheck | None, op: str) -> None:
        self.result, self.owner, self.op = result, owner, op
        self.event: torch.cuda.Event | None = None
        self.agreed: torch.Tensor | None = None
        """The result's NaN/Inf flags its launch returned, agreed over the ranks when the
        backward ended, before ``event`` (None: checked when applied)."""

    def wait(self) -> torch.Tensor:
        """The result, complete for the current stream (on CUDA the stream waits, the host
        does not)."""
        if self.event is not None:
            torch.cuda.current_stream(self.result.device).wait_event(self.event)
        return self.result


class _Local(NamedTuple):
    """This rank's own share of a gradient in flight (weight prediction's estimate) and, on
    CUDA, the event where the stream that wrote it passed the write."""

    buffer: torch.Tensor
    event: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        """The estimate, complete for the current stream, which then holds its memory (it
        was written on a side stream, whose work the caching allocator otherwise follows)."""
        if self.event is not None:
            stream = torch.cuda.current_stream(self.buffer.device)
            stream.wait_event(self.event)
            self.buffer.record_stream(stream)
        return self.buffer


class DelayedReductions:
    """Staleness 1 of one model: the reductions in flight, per parameter, and the state a
    checkpoint keeps ([Note: one staleness core]).

    Args:
        params: the model's parameters by name (the checkpoint's keys); those that require a
            gradient are saved.
        local_tag: where this rank's local estimates differ from its peers' and must be saved
            under keys of their own (``"rank3"`` under DDP, ``"replica1"`` under compressed
            HSDP); ``""`` where they are one shard per rank, placed like the parameters.
        owner: what checks a drained result for NaN/Inf where :meth:`send` names no owner
            and no :meth:`register`-ed hook holds the parameter (DDP's hook, whose results are
            the same bits on every rank and need no agreement).
        start: ``Schedule.start``: when the delayed schedule starts ([Note: when staleness 1
            starts] in ``qsdp.runtime.stale_start``); before, the hooks reduce at once.
    """

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        *,
        local_tag: str = "",
        owner: AppliedCheck | None = None,
        start: int | str = 0,
    ) -> None:
        self.start = StaleStart(start)
        """When the delayed schedule starts, and the synchronous backwards before it."""
        self.streams = SideStreams(2)
        """The side streams every delayed reduction runs on, two per device, alternating."""
        self._names = {n: p for n, p in params.items() if p.requires_grad}
        self._pending: dict[int, tuple[_InFlight, Slot]] = {}
        """By parameter id: the reduction its gradient of the last step is in, and where."""
        self._local: dict[int, tuple[_Local, Slot]] = {}
        self._last: dict[object, _InFlight] = {}
        """By hook key: its last reduction (whose buffer ``reuse`` may take again)."""
        self._turns: dict[object, int] = {}
        self._hooks: list[tuple[AppliedCheck, list[Slot], int]] = []
        """:meth:`register`-ed hooks: their fixed slots and buffer size."""
        self._owner = owner
        self.local_tag = local_tag
        self.applied_nothing = True
        """Whether the last backward's hooks applied no reduction (the first step, or the one
        after a drain): skip that step's ``optimizer.step()``."""
        self.synchronous = False
        """Set by a state's ``synchronous()``: the hooks reduce and apply at once."""
        self.keep_local = False
        """The hooks keep each rank's own share of the gradient in flight
        (:meth:`keep_local_gradients`)."""
        self._to_agree: list[tuple[_InFlight, FlagsToAgree]] = []
        """This backward's reductions and their flags, agreed when it ends."""
        self._agree_queued = -1
        """The backward whose final callback agrees them, -1 for none."""

    def register(self, owner: AppliedCheck, slots: Sequence[Slot], *, size: int) -> None:
        """A hook whose parameters always lie in one buffer of ``size`` elements at ``slots``
        (FSDP2's flat shard): a restored checkpoint's results are laid out so, and checked by
        it when drained."""
        self._hooks.append((owner, list(slots), size))

    # --- in a backward ----------------------------------------------------------------------
    @property
    def reduce_now(self) -> bool:
        """The hooks reduce and apply at once: inside ``synchronous()``, or before the delayed
        schedule starts (then they hand their results to :meth:`reduced_now`)."""
        return self.synchronous or not self.start.started

    def reduced_now(
        self,
        result: torch.Tensor | torch.futures.Future,
        group: dist.ProcessGroup | None,
    ) -> None:
        """A hook reduced at once (:attr:`reduce_now`): before the start, its ``result`` (the
        same on the ranks that replicate it) is counted and measured (:class:`StaleStart`;
        ``group``: the ranks whose results add up to the whole gradient)."""
        if not self.start.started:
            self.start.observe(result, group)

    @property
    def in_flight(self) -> bool:
        """A reduction is in flight: the next backward applies it."""
        return bool(self._pending)

    def check_synchronous(self, slots: Sequence[Slot]) -> None:
        """A synchronous backward of these parameters, one of whose reductions is still in
        flight, would lose it: raise."""
        if any(id(s.param) in self._pending for s in slots):
            raise RuntimeError(
                "qsdp staleness 1: a synchronous backward while a reduction is in flight would "
                "lose it; call drain() (and optimizer.step()) before synchronous()"
            )
        self.applied_nothing = False

    def previous(self, slots: Sequence[Slot], *, like: torch.Tensor) -> torch.Tensor | None:
        """The last step's results of ``slots``' parameters laid out as ``like`` (a hook's
        flat buffer of them), complete for the current stream; zeros where a parameter has
        none, None where none has. Where one reduction holds them all, laid out as ``like``,
        its buffer itself: a hook that hands it on (DDP's future) must not ask its next
        :meth:`send` to ``reuse`` it."""
        sources = [self._pending.get(id(s.param)) for s in slots]
        held = [(slot, src) for slot, src in zip(slots, sources, strict=True) if src is not None]
        self.applied_nothing = not held
        if not held:
            return None
        for flight in {id(f): f for _, (f, _) in held}.values():
            flight.wait()
        first = held[0][1][0]
        if len(held) == len(slots) and first.result.numel() == like.numel():
            if all(f is first and s.offset == mine.offset for mine, (f, s) in held):
                return first.result.view_as(like)
        out = torch.zeros_like(like).view(-1)
        torch._foreach_copy_(
            [out[mine.offset : mine.offset + mine.numel] for mine, _ in held],
            [f.result.view(-1)[s.offset : s.offset + s.numel] for _, (f, s) in held],
        )
        return out.view_as(like)

    def agreed_flags(self, slots: Sequence[Slot]) -> torch.Tensor | None:
        """The NaN/Inf flags, agreed over the ranks, of the result :meth:`previous` returned
        for ``slots`` (complete for the current stream once :meth:`previous` waited for it),
        where one reduction sent them all at their own places and they were agreed when its
        backward ended ([Note: flags agreed where they were reduced]); else None."""
        first = self._pending.get(id(slots[0].param)) if slots else None
        if first is None or first[0].agreed is None:
            return None
        flight = first[0]
        for slot in slots:
            held = self._pending.get(id(slot.param))
            if held is None or held[0] is not flight or held[1].offset != slot.offset:
                return None
        return flight.agreed

    def send(
        self,
        launch: Callable[[torch.Tensor, Callable[[torch.Tensor], None]], object],
        *,
        key: object,
        slots: Sequence[Slot],
        like: torch.Tensor,
        input: torch.Tensor,
        owner: AppliedCheck | None,
        op: str = "avg",
        in_place: bool = False,
        reuse: bool = False,
        local: torch.Tensor | None = None,
    ) -> None:
        """Start ``launch(result, keep_local)`` (the plan's collective writing ``result``,
        shaped as ``like``; it may return the result's NaN/Inf flags agreed over the ranks,
        [Note: flags agreed where they were reduced]) after everything the current stream
        did, on the side stream of
        ``key`` (a hook's own: the hooks alternate between the two). ``input``: what the
        collective reads, marked as used by that stream; ``in_place``: ``input`` is the result
        (an all-reduce of a copy the hook made); ``reuse``: the key's last result buffer may be
        written again (its hook copied it out). ``slots``: where its parameters lie in
        ``result``. ``owner``: the hook, which checks the result for NaN/Inf if it is drained.
        ``op``: the reduction FSDP2 asked for (results are averages only under ``"avg"``).
        ``local``: this rank's share of the gradient, copied as its local estimate when
        :attr:`keep_local` (or the launch hands one to ``keep_local``)."""
        last = self._last.get(key)
        if in_place:
            result = input
        elif (
            reuse
            and last is not None
            and last.result.shape == like.shape
            and last.result.dtype == like.dtype
        ):
            result = last.result
        else:
            result = torch.empty_like(like)
        flight = self._last[key] = _InFlight(result, self._owner if owner is None else owner, op)
        for slot in slots:
            self._pending[id(slot.param)] = (flight, slot)
            self._local.pop(id(slot.param), None)
        keep = self._keeper(slots, like) if self.keep_local else _ignore
        if self.keep_local and local is not None:
            keep(local)
        if not like.is_cuda:
            # gloo: synchronous, applied one step late all the same
            self._to_be_agreed(flight, launch(result, keep))
            return
        turn = self._turns.setdefault(key, len(self._turns))
        stream = self.streams.get(like.device, turn)
        # the caching allocator must not hand these out again before the stream used them
        result.record_stream(stream)
        input.record_stream(stream)
        stream.wait_stream(torch.cuda.current_stream(like.device))
        with torch.cuda.stream(stream):
            flags = launch(result, keep)
            flight.event = stream.record_event()
        self._to_be_agreed(flight, flags)

    def _to_be_agreed(self, flight: _InFlight, flags: FlagsToAgree | None) -> None:
        """Agree ``flags`` (of ``flight``'s result) when this backward ends, with the rest of
        its flags ([Note: flags agreed where they were reduced])."""
        if flags is None:
            return
        task = torch._C._current_graph_task_id()
        if task == -1:  # (outside a backward: at once)
            self._agree([(flight, flags)])
            return
        if task != self._agree_queued:  # a new backward (drop what a failed one left)
            self._to_agree = []
            self._agree_queued = task
            torch.autograd.Variable._execution_engine.queue_callback(self._agree_backward)
        self._to_agree.append((flight, flags))

    def _agree_backward(self) -> None:
        """A backward's end: its flags agreed, one all-reduce per communicator."""
        sent, self._to_agree, self._agree_queued = self._to_agree, [], -1
        self._agree(sent)

    def _agree(self, sent: list[tuple[_InFlight, FlagsToAgree]]) -> None:
        """The flags of ``sent`` agreed (:func:`qsdp.runtime.nonfinite.agree_together`: one
        all-reduce per communicator); on CUDA on a side stream after their launches, each
        flight's event moved past it."""
        flags, groups = [f.flags for _, f in sent], [(f.group,) for _, f in sent]
        device = flags[0].device
        if device.type != "cuda":
            agreed = agree_together(flags, groups)
        else:
            stream = self.streams.get(device, 0)
            for (flight, _), f in zip(sent, flags, strict=True):
                stream.wait_event(flight.event)
                f.record_stream(stream)
            with torch.cuda.stream(stream):
                agreed = agree_together(flags, groups)
                event = stream.record_event()
            for flight, _ in sent:
                flight.event = event
        for (flight, _), a in zip(sent, agreed, strict=True):
            flight.agreed = a

    def _keeper(self, slots: Sequence[Slot], like: torch.Tensor) -> Callable:
        """``keep_local(estimate)``: ``estimate`` (this rank's share, laid out as ``like``),
        copied in ``like``'s dtype as the slots' local estimate; on CUDA an event marks where
        the current stream wrote it (the side stream, inside a launch)."""

        def keep(estimate: torch.Tensor) -> None:
            buffer = estimate.to(like.dtype, copy=True).view(-1)
            event = None
            if buffer.is_cuda:
                event = torch.cuda.current_stream(buffer.device).record_event()
            entry = _Local(buffer, event)
            for slot in slots:
                self._local[id(slot.param)] = (entry, slot)

        return keep

    # --- weight prediction ------------------------------------------------------------------
    def keep_local_gradients(self) -> None:
        """From the next backward on, each delayed reduction keeps this rank's own share of its
        input, for :meth:`local_gradients`."""
        self.keep_local = True

    def local_gradients(self, *, take: bool = False) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's share of this rank's own gradient of the step in flight, shaped as
        its local tensor (an unbiased estimate of the averaged gradient the next backward
        applies), complete for the current stream (it waits for the copy, not for the
        reduction); empty when nothing is in flight. ``take``: handed over, kept here no longer.

        [Note: estimates handed over]
        The estimates are kept from a backward to the next forward, whose prediction reads
        them once. Kept on after that read, they would lie through the forward, where a step's
        memory peaks (its activations): 2 bytes per element of the local shards, bf16, a
        quarter of what staleness 1 added at the peak (measured, 2x H200, GPT 1.42 B over
        sockets, ``benchmarks/memory_peak.py``: the prediction's copies of the shards 2.64 GiB,
        the results in flight 1.32, the estimates 1.32). The prediction takes them
        (``take=True``): their memory returns once it has computed the predicted step, and
        the next backward keeps new ones. A checkpoint saved between that forward and the
        step (when the parameters are the predicted ones anyway) saves zeros for them."""
        held = []
        for i, (flight, _) in self._pending.items():
            if i in self._local:
                _check_avg(flight, "local gradient estimates need it")
                held.append(self._local[i])
        out = {slot.param: view for slot, view in _waited_views(held)}
        if take:
            self._local = {}
        return out

    def estimates_of(self, slots: Sequence[Slot]) -> dict[int, torch.Tensor]:
        """This rank's estimates of ``slots``' parameters kept by this backward, by parameter
        id, shaped as their local tensors and complete for the current stream; kept here (a
        gather ahead reads them before the next forward takes them)."""
        held = [h for slot in slots if (h := self._local.get(id(slot.param))) is not None]
        return {id(slot.param): view for slot, view in _waited_views(held)}

    # --- after the last backward ------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every reduction in flight and put it into the parameters' ``.grad`` (then
        call ``optimizer.step()`` once more), after its hook's NaN/Inf check (raised on every
        rank under ``"raise"``). A no-op when nothing is in flight. Call on every rank."""
        pending, self._pending = self._pending, {}
        self._local = {}
        flights = {id(f): f for f, _ in pending.values()}
        for flight in flights.values():
            _check_avg(flight, "qsdp staleness 1 cannot drain it")
            result = flight.wait()
            if flight.owner is not None:
                flight.owner.check_applied(result)
        for flight, slot in pending.values():
            p = slot.param
            grad = _view(flight.result, slot).to(p.dtype)
            if p.grad is None:
                p.grad = like_param(grad.clone(), p)
            else:
                local_of(p.grad).copy_(grad)
        self._last = {}
        self.applied_nothing = True

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The results in flight, one tensor per parameter shaped and placed like it (float32;
        zeros where none is), and with :attr:`keep_local` this rank's estimates."""
        out = {"pending": torch.tensor([int(self.in_flight)])}
        out.update({f"start.{k}": v for k, v in self.start.state_dict().items()})
        tag = f"{self.local_tag}." if self.local_tag else ""
        for name, p in self._names.items():
            out[f"pending.{name}"] = _saved(self._pending.get(id(p)), p)
            if self.keep_local:
                out[f"local.{tag}{name}"] = _saved(self._local.get(id(p)), p)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s results in flight: a registered hook's laid out in one
        buffer as it sends them, any other parameter's in a buffer of its own."""
        self._pending, self._local, self._last = {}, {}, {}
        self.start.load_state_dict(
            {k[len("start.") :]: v for k, v in state.items() if k.startswith("start.")}
        )
        self.applied_nothing = not int(state["pending"])
        if self.applied_nothing:
            return
        tag = f"{self.local_tag}." if self.local_tag else ""
        names = {id(p): n for n, p in self._names.items()}
        layouts = list(self._hooks)
        seen = {id(s.param) for _, slots, _ in layouts for s in slots}
        layouts += [
            (self._owner, padded_slots([(p, local_of(p).numel())]), local_of(p).numel())
            for p in self._names.values()
            if id(p) not in seen
        ]
        for owner, slots, size in layouts:
            slots = [s for s in slots if id(s.param) in names]
            if not slots:
                continue
            device = local_of(slots[0].param).device
            flight = _InFlight(torch.zeros(size, device=device), owner, "avg")
            estimate = _Local(torch.zeros(size, device=device), None) if self.keep_local else None
            for slot in slots:
                name = names[id(slot.param)]
                _view(flight.result, slot).copy_(local_of(state[f"pending.{name}"]))
                self._pending[id(slot.param)] = (flight, slot)
                if estimate is not None:
                    _view(estimate.buffer, slot).copy_(local_of(state[f"local.{tag}{name}"]))
                    self._local[id(slot.param)] = (estimate, slot)


def _ignore(_: torch.Tensor) -> None:
    return None


def _view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``slot``'s piece of ``flat``, shaped as its parameter's local tensor."""
    return slot.of(flat)


def _saved(held: tuple | None, p: nn.Parameter) -> torch.Tensor:
    """A parameter's piece of a buffer held in flight (or of an estimate), for a checkpoint:
    float32, shaped and placed like ``p``; zeros without one."""
    local = local_of(p)
    if held is None:
        piece = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
    else:
        source, slot = held
        piece = _view(source.wait(), slot).float().clone()
    return like_param(piece, p)


def _check_avg(flight: _InFlight, what: str) -> None:
    """A result or estimate is the average only under AVG: FSDP2 divides the others itself,
    with factors qsdp does not see."""
    if flight.op != "avg":
        raise ValueError(
            f"FSDP2 ran this reduction with op {flight.op!r}, not AVG; {what}: use a float32 or "
            "bfloat16 reduce_dtype, and no set_gradient_divide_factor"
        )
