"""The FSDP2 all-gathers: quantized weights, weight differences (SDP4Bit), quantized master
(QSDP's theory setting). See ``_hooks.py`` for what FSDP2 hands them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import comm as qc
from ..quant import QuantSpec
from ..quant import decode as qc_decode
from ..quant import decode_rows as qc_decode_rows
from ..quant import encode as qc_encode
from ..runtime.delayed import slot_views
from ..runtime.gathered import GatheredPrediction
from ..runtime.streams import SideStreams
from ._hooks import StepClock, _Counter, _Gather, _usable

__all__ = [
    "QuantizedAllGather",
    "QuantizedMasterAllGather",
    "WeightDiffAllGather",
]


class QuantizedAllGather(_Gather):
    """FSDP2 all-gather through :func:`qsdp.comm.all_gather`."""

    def __init__(
        self,
        spec: QuantSpec,
        *,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        split: qc.Split | None = None,
        module_name: str = "",
        prediction: GatheredPrediction | None = None,
        slots: Sequence = (),
        graphs: qc.CodecGraphs | None = None,
    ) -> None:
        """``prediction``, ``slots``: staleness 1's prediction of the group's parameters at
        ``slots`` of the input ([Note: the prediction in the gathers] in
        ``qsdp.runtime.gathered``), written there before each gather. ``graphs``: the model's
        captured codec segments (``Schedule.graphs``: each gather replays them)."""
        self.spec, self.seed, self.bucket, self.stats = spec.propagating(), seed, bucket, stats
        self.split, self.module_name = split, module_name
        self.graphs = graphs
        self.prediction, self.slots = prediction, list(slots)
        self._steps = _Counter()

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        if self.prediction is not None:  # (the backward's re-gather writes the same values)
            self.prediction.write(self.slots, input_tensor)
        # codes and the policy's raw values in one all-gather ([Note: policies inside flat
        # buffers] in qsdp.comm)
        qc.all_gather(
            output_tensor,
            input_tensor,
            group,
            spec=self.spec,
            split=_usable(self.split, input_tensor.numel(), self.stats),
            seed=self.seed,
            step=self._steps.next(),
            bucket=self.bucket,
            stats=self.stats,
            graphs=self.graphs,
        )
        return None


class _Versions:
    """Whether a group's sharded parameters were written since the last gather.

    The step clock ticks on the root's forward, but a gather can come from anywhere:
    ``FSDPModule.unshard()`` after ``optimizer.step()`` (evaluation, generation, RL rollouts)
    must see the new weights, not the reconstruction of the old ones. In-place writes
    (optimizer steps, ``copy_``, checkpoint loads) bump a tensor's version counter, so a
    gather is served from the cache only if no parameter's counter moved since it was made.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self._seen: list[int] | None = None

    def _now(self) -> list[int]:
        return [p._version for p in self.params]

    def changed(self) -> bool:
        return self._seen != self._now()

    def record(self) -> None:
        self._seen = self._now()


class _Ahead:
    """A gather made ahead, in a backward ([Note: the next step's weights in this backward] in
    ``qsdp.runtime.gathered``): what the next forward's gather checks before it is served
    from it."""

    __slots__ = ("step", "generation", "event", "optimizers", "stepped")

    def __init__(
        self, step: int, generation: int, event: torch.cuda.Event | None, optimizers: set[int]
    ) -> None:
        self.step, self.generation, self.event = step, generation, event
        self.optimizers = optimizers
        """The ids of the optimizers whose coming step it anticipated."""
        self.stepped = False
        """The next optimizer step after it was one of those (its post-hook ran)."""

    def wait(self, device: torch.device) -> None:
        """The reconstruction it wrote, complete for the current stream (the host never
        waits)."""
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)


class WeightDiffAllGather(_Gather):
    """FSDP2 all-gather of SDP4Bit weight differences (:func:`qsdp.comm.all_gather_diff`).

    Keeps the reconstruction of the group's gathered weights (param dtype: 2 bytes per parameter
    for bf16). The first gather, the first after a resync request and every
    ``resync_every``-th difference gather send full precision; FSDP's re-gather in backward
    (same :class:`StepClock` epoch) is served from the reconstruction without communication.
    """

    def __init__(
        self,
        spec: QuantSpec,
        *,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        clock: StepClock,
        params: Sequence[torch.nn.Parameter] = (),
        resync_every: int = 0,
        check_replicas: bool = False,
        module_name: str = "",
        prediction: GatheredPrediction | None = None,
        slots: Sequence = (),
        streams: SideStreams | None = None,
        graphs: qc.CodecGraphs | None = None,
    ) -> None:
        """``prediction``, ``slots``: as :class:`QuantizedAllGather`'s; the gathers of the rest
        of an armed step are served from the reconstruction, so the estimates are dropped
        once gathered. ``streams``: where its gathers ahead run on CUDA (``Schedule(
        gather_ahead=True)``, :meth:`gather_ahead`). ``graphs``: the model's captured codec
        segments (``Schedule.graphs``: each difference gather replays them)."""
        self.spec, self.seed, self.bucket, self.stats = spec.propagating(), seed, bucket, stats
        self.module_name = module_name
        self.prediction, self.slots = prediction, list(slots)
        self._predicted_step = -1
        self.clock, self.resync_every, self.check_replicas = clock, resync_every, check_replicas
        self.versions = _Versions(params)
        self.recon: torch.Tensor | None = None
        self._epoch = -1
        self._generation = -1
        self._diffs = 0
        self._steps = _Counter()
        self.cached_gathers = 0
        """Gathers served from the reconstruction without communication (FSDP's re-gathers)."""
        self.streams, self.graphs = streams, graphs
        self._group: dist.ProcessGroup | None = None
        self._ahead: _Ahead | None = None
        self.gathered_ahead = 0
        """Gathers made ahead, in a backward (:meth:`gather_ahead`)."""
        self.served_ahead = 0
        """Forward gathers served from a gather made ahead."""

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        self._group = group
        pred = self.prediction
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._serves(ahead, output_tensor):
            ahead.wait(output_tensor.device)
            output_tensor.copy_(self.recon)
            self._epoch = self.clock.epoch
            self._predicted_step = pred.step
            pred.drop(self.slots)  # (gathered: the rest of the step is served from recon)
            self.served_ahead += 1
            return None
        fresh = self.recon is None or self.recon.shape != output_tensor.shape
        same = ahead is None and (  # (recon holds weights gathered ahead: gather anew)
            self.clock.epoch == self._epoch
            or (pred is not None and pred.armed and pred.step == self._predicted_step)
        )  # (an armed step's gathers all send the same predicted weights)
        if not fresh and same and not self.versions.changed():
            output_tensor.copy_(self.recon)  # weights unchanged since the last gather
            self.cached_gathers += 1
            return None
        # staleness 1: the predicted weights over FSDP2's copy of the shards; but a gather made
        # ahead overwrote those this armed step sent, and its estimates are spent: a forward
        # again in it (its optimizer.step() skipped) computes at the parameters as they are
        spent = ahead is not None and pred.armed and pred.step == self._predicted_step
        predicted = pred is not None and not spent and pred.write(self.slots, input_tensor)
        exact = (
            fresh
            or self._generation != self.clock.generation
            or (self.resync_every > 0 and self._diffs >= self.resync_every)
        )
        if fresh or self.recon.dtype != output_tensor.dtype:
            self.recon = torch.empty_like(output_tensor)
        self._gather(output_tensor, input_tensor, group, exact=exact)
        self._epoch, self._generation = self.clock.epoch, self.clock.generation
        self.versions.record()
        if predicted:  # later gathers of this step are served from the reconstruction
            self._predicted_step = pred.step
            pred.drop(self.slots)
        return None

    def _gather(
        self,
        output: torch.Tensor | None,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        exact: bool,
    ) -> None:
        """The weight differences of ``input`` gathered into the reconstruction (and into
        ``output``, unless None), under the next noise key; the replicas checked if asked."""
        qc.all_gather_diff(
            output,
            input,
            self.recon,
            group,
            spec=self.spec,
            exact=exact,
            seed=self.seed,
            step=self._steps.next(),
            bucket=self.bucket,
            stats=self.stats,
            graphs=self.graphs,
        )
        self._diffs = 0 if exact else self._diffs + 1
        if self.check_replicas:
            _check_replicas(self.recon, group)

    def _serves(self, ahead: _Ahead, output: torch.Tensor) -> bool:
        """Whether this forward gather may be served from the gather made ahead: it is the
        step it was made for (a training forward, predicted, after one ``optimizer.step()``
        and no other write of the parameters, no resync requested since)."""
        pred = self.prediction
        return (
            ahead.stepped
            and pred is not None
            and pred.armed
            and pred.step == ahead.step
            and ahead.generation == self.clock.generation
            and self.recon is not None
            and self.recon.shape == output.shape
            and self.recon.dtype == output.dtype
            and not self.versions.changed()
        )

    def gather_ahead(
        self,
        *,
        applied: torch.Tensor,
        slots: Sequence,
        estimates: Callable[[], dict[int, torch.Tensor]],
    ) -> torch.cuda.Event | None:
        """Gather the group's weights of the next step into the reconstruction now, in the
        backward that has just applied ``applied`` (a reduce-scatter's output: the gradients
        the coming ``optimizer.step()`` applies, at ``slots``), with ``estimates()`` (this
        rank's shares of the gradients now in flight, complete for the current stream) for
        the prediction from there ([Note: the next step's weights in this backward] in
        ``qsdp.runtime.gathered``). Returns the event at its end on CUDA (None elsewhere, or
        where it did not gather: not before this group's first gather, nor when a resync is
        due (the forward gathers exactly), nor where the prediction lacks an optimizer's
        state)."""
        pred, group, recon = self.prediction, self._group, self.recon
        if pred is None or group is None or recon is None:
            return None
        if self._generation != self.clock.generation:
            return None
        n = group.size()
        device = recon.device
        # the optimizer's step taken on copies here, on the stream the backward wrote the
        # gradient on: the optimizer.step() that writes the parameters and moments comes after
        # it (FSDP2's compute stream waits for its reduce-scatter stream when the backward ends)
        flat = torch.zeros(recon.numel() // n, dtype=recon.dtype, device=device)
        # float32 and finite once for the whole buffer ([Note: a non-finite estimate predicts
        # nothing] in qsdp.runtime.adam_step), not once per parameter
        clean = torch.nan_to_num(applied.to(torch.float32), nan=0.0, posinf=0.0, neginf=0.0)
        grads = {id(s.param): v for s, v in zip(slots, slot_views(clean, slots), strict=True)}
        taken = pred.take_step(self.slots, flat, grads=grads)
        if taken is None:
            return None
        stream = None
        if device.type == "cuda" and self.streams is not None:
            # the prediction from there and the gather on a stream of their own, after the
            # step's copies; recon's last reader (this group's re-gather) ran before the
            # gradient this stream now waits for
            stream = self.streams.get(device, 0)
            stream.wait_stream(torch.cuda.current_stream(device))
            flat.record_stream(stream)
            for _, _, new, states in taken:
                read = [*new, *(t for s in states for t in s.values())]
                for t in read:
                    if isinstance(t, torch.Tensor):
                        t.record_stream(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if not pred.predict_from(taken, flat, estimates=estimates()):
                return None
            exact = self.resync_every > 0 and self._diffs >= self.resync_every
            self._gather(None, flat, group, exact=exact)
            event = stream.record_event() if stream is not None else None
        optimizers = {id(first.optimizer) for _, first, _, _ in taken}
        self._ahead = _Ahead(pred.step + 1, self.clock.generation, event, optimizers)
        pred.after_step(self._stepped)
        self.gathered_ahead += 1
        return event

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """The first optimizer step after a gather made ahead: if it is the step the gather
        anticipated, the parameters as it left them are those gathered; any later write (or
        another optimizer's step first) makes the next forward gather anew."""
        if self._ahead is not None and id(optimizer) in self._ahead.optimizers:
            self._ahead.stepped = True
            self.versions.record()


def _check_replicas(recon: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Raise if the ranks' reconstructions differ (a float64 checksum compared by MAX/-MAX)."""
    weights = torch.arange(1, recon.numel() + 1, device=recon.device, dtype=torch.float64)
    c = (recon.reshape(-1).double() * weights.remainder(97)).sum()
    both = torch.stack((c, -c))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if float(both[0]) != -float(both[1]):
        raise RuntimeError(
            "qsdp weight-difference reconstructions diverged across ranks (checksums "
            f"{float(-both[1])} .. {float(both[0])}); call qsdp.fsdp.resync(model) and report it"
        )


class QuantizedMasterAllGather(_Gather):
    """QSDP's quantized-master all-gather: project the master shard onto the weight lattice,
    then gather its codes (lossless with respect to the master).

    At a step's first gather the shard (FSDP's all-gather input: the group's fp32 master shards,
    padded, in order) is encoded with the shift-lattice quantizer (stochastic rounding, the
    step's dither shared by all ranks), the decoded values are written back into the master
    parameters, and the payloads are all-gathered and decoded. Later gathers of the same step
    decode the kept payloads again without communication (1 byte per parameter for 8 bits).
    """

    def __init__(
        self,
        spec: QuantSpec,
        *,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        clock: StepClock,
        params: list[tuple[torch.nn.Parameter, int]],
        module_name: str = "",
    ) -> None:
        self.spec, self.seed, self.bucket, self.stats = spec.propagating(), seed, bucket, stats
        self.clock, self.params, self.module_name = clock, params, module_name
        self.versions = _Versions([p for p, _ in params])
        self._epoch = -1
        self._recv: torch.Tensor | None = None
        self._steps = _Counter()
        self.cached_gathers = 0

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        n, m = group.size(), input_tensor.numel()
        nbytes = self.spec.payload_bytes(m)
        if self._recv is None or self._epoch != self.clock.epoch or self.versions.changed():
            stored = sorted({str(p.dtype) for p, _ in self.params if p.dtype != torch.float32})
            if stored:
                raise ValueError(
                    f"the quantized-master recipe keeps an fp32 master on the lattice; module "
                    f"'{self.module_name or '<root>'}' stores its parameters in {stored}: "
                    "build the model in float32 (model.float() before fully_shard; bf16 compute "
                    "through MixedPrecisionPolicy is not possible with this recipe), or use "
                    "'qsdp-w8g8'"
                )
            if input_tensor.dtype != torch.float32:
                raise ValueError(
                    f"the quantized-master recipe gathers the fp32 master itself, but FSDP2 "
                    f"hands module '{self.module_name or '<root>'}' its weights in "
                    f"{input_tensor.dtype} (a MixedPrecisionPolicy(param_dtype=...)): drop the "
                    "param_dtype for these modules, or use 'qsdp-w8g8'"
                )
            step = self._steps.next()
            send = torch.empty(nbytes, dtype=torch.uint8, device=input_tensor.device)
            enc = qc_encode(
                input_tensor,
                self.spec,
                seed=self.seed,
                step=step,
                stream=qc.noise_stream(qc.noise_rank(group), 0, bucket=self.bucket),
                out=send,
            )
            self._write_master(qc_decode(enc))
            self.versions.record()
            self._recv = qc.all_gather_payloads(
                send, group, stats=self.stats, name="all_gather_master"
            )
            self._epoch = self.clock.epoch
        else:
            self.cached_gathers += 1
        qc_decode_rows(self._recv, m, self.spec, out=output_tensor.view(n, m))
        return None

    @torch.no_grad()
    def _write_master(self, values: torch.Tensor) -> None:
        """Copy the projected shard into the master parameters (their padded segments)."""
        offset = 0
        for p, padded in self.params:
            local = p.to_local().view(-1)
            local.copy_(values[offset : offset + local.numel()])
            offset += padded
