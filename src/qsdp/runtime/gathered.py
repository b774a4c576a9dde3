"""Weight prediction in the weights an FSDP2 all-gather sends, the parameters never moved.

[Note: the prediction in the gathers]
Staleness 1 as shipped predicts each step's weights ([Note: prediction in the schedule] in
``qsdp.runtime.prediction``). Moving the parameters there and back needs a copy of every local
shard for the way back (4 bytes per element of the fp32 shards), held through the forward,
where a step's memory peaks: on 2x H200 (GPT 1.42 B over sockets, ``benchmarks/memory_peak.py``)
it was half of what staleness 1 added at the peak (2.64 of 5.28 GiB). Under FSDP2 the
predicted weights are needed only where an all-gather reads them, cast to the compute dtype:
so where qsdp runs a group's all-gather (quantized weights, weight differences) the hook
writes the predicted values itself into the gather's input, over FSDP2's copy of the shards,
computed on float32 copies by the same fused step and cast as FSDP2 casts. The gathered bits
are those of the moved parameters, and the parameters themselves never move: no copy, no way
back, and between a backward and its ``optimizer.step()`` they read as they are.

:class:`GatheredPrediction` is armed with the step's estimates by the forward pre-hook that
predicts, and disarmed by the next ``optimizer.step()`` (or ``drain()``). A weight-difference
gather keeps what it reconstructed: every later gather of the group in the same armed step
(FSDP2's backward re-gather, the forwards of gradient accumulation) is served from it, so its
estimates are dropped once it has gathered (their memory returns before the peak). A quantized
all-gather gathers again in the backward: its estimates stay until the step. A gather that
would need estimates already dropped (a parameter written in place between the forward and
the step) raises.

[Note: the next step's weights in this backward]
Under the prediction above, step ``t + 1``'s forward gathers each group's weights as the
optimizer's step ``t`` will leave them, moved once more by the prediction with this rank's
gradient of step ``t`` (then in flight). Both are known before step ``t + 1`` begins: once a
group's reduce-scatter hook in step ``t``'s backward has applied the delayed gradient (step
``t - 1``'s, the one ``optimizer.step()`` is about to apply) and kept this rank's own
gradient, its weights of step ``t + 1`` are fixed. ``Schedule(gather_ahead=True)`` gathers
them there: :meth:`GatheredPrediction.take_step` takes the optimizer's step on float32 copies
of the values and moments (torch's fused kernel, ``adam_step.stepped``) on the reduce-scatter's
stream, which the optimizer's step follows (taken on the gather's stream, it could read the
parameters after the step had written them: the GPU test found it);
:meth:`GatheredPrediction.predict_from` predicts from there and
``WeightDiffAllGather.gather_ahead`` gathers the difference into the reconstruction the
backward has just finished reading, on a stream of their own and on FSDP2's communicator,
which the backward leaves idle while the delayed reductions use their twin (after the
group's reduction: made to go first, the step was 4-7% slower on 2x H200, whose host bounds
it). The next forward's gathers are served from the reconstruction. Measured on 2x H200 over
sockets (GPT 1.42 B, ``benchmarks/results/session27_2026-11-28/``): the forward's 25 weight
all-gathers had run alone on the link before, 125-155 ms a step, the backward's all-to-alls
alone after; gathered ahead, the two run at once in the backward, and the step ran x1.42-1.56
the synchronous one back to back (staleness 1 alone x1.22-1.28 in the same calls).

The gathered weights are those of the shipped schedule only if the coming step is the one
anticipated. With a fused AdamW (``fused=True``: the kernel the copies are stepped by) and a
constant learning rate the run is the shipped one bit for bit (tested on gloo and on NCCL);
torch's default AdamW rounds its step otherwise; the prediction from there takes step ``t``'s
learning rate (a scheduler sets step ``t + 1``'s after the step); and a change the loop makes
between the backward and ``optimizer.step()`` (gradient clipping, a learning rate set by hand)
is missed for one step: the gathered weights are off by it, and the next gather's difference
(against the reconstruction) corrects them, as it corrects a prediction's error. A forward
that is not the anticipated one gathers anew: an evaluation (not predicted), a forward after a
parameter was written once the step was taken (the step's post-hook records the parameters'
versions), a forward whose first optimizer step since was not that of the parameters'
optimizer (a step skipped by a loss scaler: its estimates spent, it computes at the parameters
as they are), after a resync request. Off by default until the convergence study
(issue 34) has run it with clipping.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from .adam_step import AdamStep, predict_step, stepped
from .delayed import slot_views
from .placement import local_of

__all__ = ["GatheredPrediction"]


class _Armed(NamedTuple):
    estimate: torch.Tensor
    group: dict
    state: dict
    adamw: bool
    coef: float | torch.Tensor
    optimizer: torch.optim.Optimizer


class GatheredPrediction:
    """The step's prediction of one model's gathered parameters ([Note: the prediction in the
    gathers]): what the all-gather hooks write into their inputs."""

    def __init__(self) -> None:
        self._armed: dict[int, _Armed] = {}
        self._dropped: dict[int, torch.optim.Optimizer] = {}
        self._owners: dict[int, _Armed] = {}
        """By parameter id: the optimizer (and its group and state) that last armed it: the
        step a gather ahead takes ([Note: the next step's weights in this backward])."""
        self._waiting: list[Callable[[torch.optim.Optimizer], None]] = []
        """Gathers made ahead, told when the optimizer's step has been taken."""
        self.step = 0
        """Armed steps so far: a gather made in step ``step`` may be served again in it."""
        self.armed = False

    def arm(
        self, optimizer: torch.optim.Optimizer, estimates: dict[nn.Parameter, torch.Tensor], coef
    ) -> None:
        """Predict the parameters of ``estimates`` that ``optimizer`` holds state for, each
        with its estimate (times ``coef``), at their next gathers."""
        adamw = isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if p in estimates and state:
                    armed = _Armed(estimates[p], group, state, adamw, coef, optimizer)
                    self._armed[id(p)] = armed
                    self._owners[id(p)] = armed._replace(estimate=None)
        if not self.armed:
            self.step += 1
        self.armed = True

    def disarm(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's end: ``optimizer``'s parameters are gathered as they are again."""
        self._armed = {k: a for k, a in self._armed.items() if a.optimizer is not optimizer}
        self._dropped = {k: o for k, o in self._dropped.items() if o is not optimizer}
        self.armed = bool(self._armed) or bool(self._dropped)

    def write(self, slots: Sequence, flat: torch.Tensor) -> bool:
        """Write the predicted values of ``slots``' parameters (``(param, offset, numel)``: their
        places in ``flat``, a gather's input of this rank's shards) over what is there, cast to
        ``flat``'s dtype; whether any was. Raises if one was dropped in this step."""
        if not self.armed:
            return False
        lost = [s for s in slots if id(s.param) in self._dropped]
        if lost:
            raise RuntimeError(
                "qsdp staleness 1: a parameter of shape "
                f"{tuple(lost[0].param.shape)} is gathered again in a step after its predicted "
                "weights were sent and their estimates dropped: it was written in place between "
                "the forward and optimizer.step(). Write parameters after optimizer.step(), or "
                "build the schedule with predict='none'"
            )
        picked = [(s, self._armed[id(s.param)]) for s in slots if id(s.param) in self._armed]
        if not picked:
            return False
        by_group: dict[int, list] = defaultdict(list)
        for slot, armed in picked:
            by_group[id(armed.group)].append((slot, armed))
        for items in by_group.values():
            first = items[0][1]
            with torch.no_grad():  # (a DTensor's to_local() is its local tensor then)
                xs = [local_of(s.param) for s, _ in items]
            step = AdamStep(
                group=first.group,
                adamw=first.adamw,
                estimates=[a.estimate for _, a in items],
                states=[a.state for _, a in items],
                clip_coef=first.coef,
            )
            # (one split of the input, not a slice per parameter: issue 32's host)
            outs = slot_views(flat, [s for s, _ in items], shaped=False)
            predict_step(outs, xs=xs, step=step)
            if flat.is_cuda:  # read on this stream: its memory stays until the read is done
                stream = torch.cuda.current_stream(flat.device)
                recorded = set()  # (the estimates are views of a buffer per hook: once each)
                for _, a in items:
                    held = a.estimate if a.estimate._base is None else a.estimate._base
                    if id(held) not in recorded:
                        recorded.add(id(held))
                        held.record_stream(stream)
        return True

    def take_step(
        self,
        slots: Sequence,
        flat: torch.Tensor,
        *,
        grads: dict[int, torch.Tensor],
    ) -> list | None:
        """The first half of the next step's weights ([Note: the next step's weights in this
        backward]): each of ``slots``' parameters with a gradient moved by the optimizer's
        coming step with ``grads[id]`` (the gradient it will apply), on float32 copies;
        one without a gradient written into ``flat`` (a gather's input: ``slots``' places,
        zeros between) as it is. Run where the optimizer's step will come after it (it reads
        the parameters and the optimizer's state). None where a parameter with a gradient
        has no optimizer that armed it; else what :meth:`predict_from` completes. ``grads``
        are float32 and finite (``adam_step.stepped``)."""
        by_group: dict[int, list] = defaultdict(list)
        flat_view = flat.view(-1)
        as_is = []
        for s in slots:
            key = id(s.param)
            if key not in grads:
                as_is.append(s)
                continue
            owner = self._owners.get(key)
            if owner is None:
                return None
            by_group[id(owner.group)].append((s, owner))
        taken = []
        with torch.no_grad():
            for s in as_is:
                flat_view[s.offset : s.offset + s.numel].copy_(local_of(s.param).reshape(-1))
            for items in by_group.values():
                first = items[0][1]
                step = AdamStep(
                    group=first.group,
                    adamw=first.adamw,
                    estimates=[grads[id(s.param)] for s, _ in items],
                    states=[first.optimizer.state.get(s.param, {}) for s, _ in items],
                    clip_coef=1.0,
                )
                new, states = stepped([local_of(s.param) for s, _ in items], step)
                taken.append(([s for s, _ in items], first, new, states))
        return taken

    def predict_from(
        self, taken: list, flat: torch.Tensor, *, estimates: dict[int, torch.Tensor]
    ) -> bool:
        """The second half: from where :meth:`take_step` left them, each parameter predicted
        with ``estimates[id]`` (this rank's share of the gradient now in flight), written into
        ``flat``. False (``flat`` incomplete) where an estimate is missing."""
        with torch.no_grad():
            for slots, first, new, states in taken:
                if any(id(s.param) not in estimates for s in slots):
                    return False
                ahead = AdamStep(
                    group=first.group,
                    adamw=first.adamw,
                    estimates=[estimates[id(s.param)] for s in slots],
                    states=states,
                    clip_coef=1.0,
                )
                predict_step(slot_views(flat, slots, shaped=False), xs=new, step=ahead)
        return True

    def after_step(self, waiting: Callable[[torch.optim.Optimizer], None]) -> None:
        """Call ``waiting(optimizer)`` after the next ``optimizer.step()`` (once)."""
        self._waiting.append(waiting)

    def step_taken(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` has run (a global post-hook): tell the gathers made ahead."""
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            w(optimizer)

    def drop(self, slots: Sequence) -> None:
        """Forget the estimates of ``slots``' parameters for the rest of the step (their gather
        keeps what it sent)."""
        for s in slots:
            armed = self._armed.pop(id(s.param), None)
            if armed is not None:
                self._dropped[id(s.param)] = armed.optimizer
