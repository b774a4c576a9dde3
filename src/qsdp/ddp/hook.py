"""The DDP comm hook: compressed gradient all-reduce (installed by ``qsdp.ddp.register``).

[Note: a DDP comm hook over a reduce plan]
DDP hands a comm hook one flat bucket of gradients at a time and waits, at the end of the
backward, for the future the hook returns. :class:`DDPCompression` is that hook: it is a thin
adapter of the gradient sub-config's :class:`qsdp.comm.ReducePlan` (``plan.all_reduce``: CGX's
two phases for quantized gradients, Global-QSGD's integer all-reduce), with

- the policy split of the bucket (1-D and small parameters exact, name patterns), built from
  the bucket's own parameters on every call and cached by their identity, so DDP's bucket
  rebuild after the first iteration (or any other layout) is always followed;
- the noise key: ``seed``, the bucket's call count as ``step``, its index as ``bucket``;
- NaN/Inf: every qsdp all-reduce leaves bit-identical results on all ranks, so a non-finite
  value anywhere shows in the same places everywhere. The future's callback flags the bucket on
  the device and zeroes it (a NaN never reaches the optimizer); the model's
  :class:`qsdp.runtime.NonfiniteCheck` takes all flags once, when the backward ends (after every
  bucket's collectives were issued on every rank), and reads them on the host when the next
  backward ends (or at :meth:`DDPCompression.check_nonfinite`), so the host never waits for the
  exchange: it raises on every rank (``"raise"``, surfacing from the next ``loss.backward()``)
  or counts (``"zero"``); ``"propagate"`` skips it all;
- optional error feedback for quantized gradients: the part of each bucket the local
  quantizer loses is added to the next step's bucket (per parameter, so it survives rebuilds).

Nothing else of DDP, and no other ``torch.distributed`` call of the user, is touched: the hook
is installed with DDP's own ``register_comm_hook``; several models carry one hook each.

[Note: the hook's own stream]
DDP calls the hook from the backward, on the compute stream. A reduce plan's collective has
stages that depend on earlier exchanges (CGX's second phase re-encodes what the first phase
summed; Global-QSGD encodes with the scale a MAX all-reduce agreed on), and each such
dependency is a ``Work.wait()``: the *current* stream waits for NCCL. Run on the compute stream,
every later backward kernel would queue behind each bucket's communication, serialising the
backward with the wire (measured on 4 GPUs over sockets: the compute stream idle for most of
the step). So on CUDA the hook runs the plan on a stream of its own, which first waits for the
compute stream (the bucket is complete there); the compute stream meets the result only through
the returned future, which DDP waits on when the backward ends, as for its own all-reduce. The
stream comes from the high-priority pool, never a communicator's or a callback's
([Note: side streams from the high-priority pool] in ``qsdp.runtime.streams``), and the future
is completed at once on it, no callback ([Note: a CUDA future without a callback]).

Uncompressed and synchronous (recipe ``"bf16"``, or what ``"auto"`` picks on a fast link), there
is nothing for a hook to do that DDP's own all-reduce does not: :func:`qsdp.ddp.register`
installs no comm hook, and NaN/Inf travel in the sum as they are (every rank receives the same,
as with native HSDP). :meth:`DDPCompression.count_native` counts its bytes, once per synchronised
backward. Measured on 4x H200 over NVLink (GPT-125M, 31 ms steps,
``benchmarks/results/auto_2026-11-26/``): the hook on its own stream with the flag cost 5 ms
per step, on the compute stream without the flag still 2 ms (a Python call per bucket).

[Note: pipelined buckets]
On its own stream and one communicator, the hook still runs the buckets' exchanges one after
another: bucket ``k``'s decode waits on the hook's stream for its all-gather, and bucket
``k + 1``'s encode queues behind it, then its all-to-all behind that all-gather on the
communicator. ``register(..., schedule=Schedule(pipeline=True))`` gives the plan's later
exchange a second communicator
(``second_group=``, [Note: two communicators]: CGX's phase 2, Global-QSGD's SUM after the MAX
of its scales) and alternates the buckets between two hook streams, so bucket ``k``'s
all-gather and bucket ``k + 1``'s all-to-all (or ``k``'s SUM and ``k + 1``'s MAX and encode) can
share the full-duplex link. Every rank issues the same collectives in
the same order on each communicator; the results are the same bits. Costs one more
communicator's NCCL buffers and a stream.

[Note: staleness 1 under DDP]
With ``Schedule(staleness=1)`` the hook is an adapter of the one staleness core
([Note: one staleness core] in ``qsdp.runtime.delayed``), on the compute stream DDP calls it on:
it takes the previous step's result for the bucket's parameters (``previous``: complete for the
stream by then, so the backward's end waits for no communication; the pieces gathered where
DDP's bucket rebuild after the first step moved them), copies the bucket (DDP refills it in the
next backward) and starts the plan's all-reduce on that copy on a side stream (``send``), and
hands DDP the previous result through a completed future, flagged for NaN/Inf as a synchronous
result is. The first step gets zeros. Memory: the copies in flight (one gradient per rank) and,
while DDP copies it out, the previous result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .. import comm as qc
from ..config import CompressionConfig, NonFinite, Schedule, check_saved, config_record
from ..policy import auto
from ..quant import zero_flagged
from ..runtime import NonfiniteCheck, SideStreams
from ..runtime.adam_step import square_norm
from ..runtime.delayed import DelayedReductions, packed_slots
from ..runtime.nonfinite import nonfinite_flags
from ..runtime.prediction import AutoPrediction, predict_with
from ..runtime.widths import WidthController

__all__ = ["DDPCompression"]

_MAX_BUCKETS = 4096  # counters kept in the checkpoint (DDP makes one bucket per ~25 MiB)


class DDPCompression:
    """The comm hook and its state (a ``torch.distributed.checkpoint`` ``Stateful``).

    Attributes:
        stats: bytes this model's hook handed to ``torch.distributed``
            (:class:`qsdp.comm.CommStats`).
        config: the :class:`qsdp.CompressionConfig` it runs.
    """

    def __init__(
        self,
        config: CompressionConfig,
        *,
        schedule: Schedule,
        names: dict[int, str],
        params: dict[str, nn.Parameter],
        group: dist.ProcessGroup | None,
        error_feedback: bool,
        second_group: dist.ProcessGroup | None = None,
        decision: auto.AutoDecision | None = None,
    ) -> None:
        self.config, self.schedule = config, schedule
        self.plan = config.grads.plan() if config.grads is not None else qc.PlainReduce()
        self.group = group
        self.second_group = second_group
        """``Schedule(pipeline=True)``: the plan's later exchange (CGX's phase 2,
        Global-QSGD's SUM) runs on this second communicator and the buckets alternate between
        two hook streams (see [Note: pipelined buckets])."""
        self._turn = 0
        self.error_feedback = error_feedback
        self.stats = qc.CommStats()
        self._names = names
        self._params = params
        """The model's parameters by name (residual shapes, staleness 1's checkpoint)."""
        self._calls: dict[int, int] = {}
        self._splits: dict[tuple, qc.Split | None] = {}
        self._buckets: dict[int, tuple[int, int, qc.Split | None]] = {}
        self._residuals: dict[str, torch.Tensor] = {}
        self._native: int | None = None
        """Uncompressed: the bytes of DDP's own all-reduce per step (see :meth:`count_native`)."""
        self._plain = config.grads is None and not schedule.staleness and not error_feedback
        """Uncompressed and synchronous: ``register`` installs no hook, DDP's own all-reduce runs
        (see [Note: the hook's own stream])."""
        mode = config.nonfinite
        self.check = None if mode is NonFinite.PROPAGATE else NonfiniteCheck(mode.value)
        self._reports: dict[int, _BucketReport] = {}  # one per bucket index, reused
        self._streams = SideStreams(2)
        self.graphs = qc.CodecGraphs() if schedule.graphs else None
        """``Schedule(graphs=True)``: the buckets' captured codec segments ([Note: two phases
        replayed] in ``qsdp.comm._two_phase``), from the second backward on: DDP rebuilds its
        buckets after the first, and a site (its buffers, about three buckets) is made per
        bucket shape, so the first backward's would be kept for nothing (a peak of 3.7 GB
        where it is 2.4 GB now: 85 M parameters in 13 buckets of 25 MiB, one H200)."""
        self._backwards = 0
        self.stale: DelayedReductions | None = None
        self.predict: AutoPrediction | None = None  # Schedule(predict="local"), set by register
        """Staleness 1: the reductions in flight ([Note: staleness 1 under DDP])."""
        if schedule.staleness:  # each rank's local estimates (its own gradient) differ
            tag = f"rank{dist.get_rank(group)}"
            self.stale = DelayedReductions(params, local_tag=tag, owner=self, start=schedule.start)
        self._drained = _BucketReport({}, where="the drained gradients")
        self.widths: WidthController | None = None
        """Adaptive widths (``CompressionConfig.adaptive``): each bucket's width, by index."""
        if config.adaptive is not None:
            self.widths = WidthController(
                config.adaptive,
                reference=self.plan.width_spec.bits,
                keys=_MAX_BUCKETS,
                seed=config.seed,
            )
        self.decision = decision
        """``register(model, "auto")``: what it measured, predicted and chose
        (:class:`qsdp.policy.AutoDecision`); :meth:`state_dict` keeps its record."""

    @property
    def applied_nothing(self) -> bool:
        """Staleness 1: the last backward applied no reduction (the first step, or the first
        after :meth:`drain`): skip its ``optimizer.step()``. Always False at staleness 0."""
        return self.stale is not None and self.stale.applied_nothing

    @property
    def delayed_since(self) -> int | None:
        """Staleness 1: the synchronous backwards before the delayed schedule started, None
        while it has not (``Schedule.start``). None at staleness 0."""
        return None if self.stale is None else self.stale.start.started_at

    @property
    def in_flight(self) -> bool:
        """Staleness 1: a reduction is in flight, to be applied by the next backward (whose
        gradient :class:`qsdp.runtime.WeightPrediction` may then compute ahead)."""
        return self.stale is not None and self.stale.in_flight

    # --- the hook ---------------------------------------------------------------------------
    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """All-reduce one bucket (average); the future yields the bucket's buffer."""
        if torch.autograd._profiler_enabled():  # one scope a bucket, as FSDP2's hooks have
            with torch.profiler.record_function(f"qsdp::ddp all-reduce (bucket {bucket.index()})"):
                return self._reduce_bucket(bucket)
        return self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        tensor = bucket.buffer()
        if self.stale is not None and not self.stale.reduce_now:
            return self._reduce_stale(bucket, tensor)  # [Note: staleness 1 under DDP]
        if not tensor.is_cuda:
            return self._reduce(bucket, tensor)
        if self.second_group is not None:  # [Note: pipelined buckets]
            self._turn ^= 1
        stream = self._streams.get(tensor.device, self._turn)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):  # see [Note: the hook's own stream]
            return self._reduce(bucket, tensor)

    def _prepare(
        self, bucket: dist.GradBucket, tensor: torch.Tensor, params: list[nn.Parameter]
    ) -> tuple[int, int, qc.Split | None]:
        """A bucket's index, noise step and policy split; error feedback's residuals added
        into it, and its width observed."""
        index = bucket.index()
        step = self._calls.get(index, 0)
        self._calls[index] = step + 1
        split = self._split(index, params)
        self._buckets[index] = (tensor.numel(), tensor.element_size(), split)
        if self.error_feedback:  # [Note: exact error feedback] in qsdp/comm/_two_phase.py
            self._add_residuals(tensor, params)
        if self.widths is not None:  # [Note: adaptive widths at run time]
            rows = tensor.view(1, -1)
            self.widths.observe(
                index,
                lambda: split.take(rows)[0] if split is not None else rows,
                self._plan_for(index).width_spec,
            )
        return index, step, split

    def _reduce(self, bucket: dist.GradBucket, tensor: torch.Tensor) -> torch.futures.Future:
        """Synchronous: all-reduce the bucket in place."""
        params = bucket.parameters()
        index, step, split = self._prepare(bucket, tensor, params)
        if self.stale is not None:  # inside synchronous(), or before staleness 1 starts
            self.stale.check_synchronous(packed_slots(params))
        feedback = self._feedback(tensor)
        if self._replays:  # replayed: synchronous, complete on the hook's stream
            self._all_reduce(tensor, split, step, index, graphs=self.graphs)
            fut = _completed(tensor)
        else:
            work = self._all_reduce(tensor, split, step, index, feedback=feedback, async_op=True)
            fut = work.get_future()
        self._keep_residuals(params, feedback)
        done = self._checked(fut, tensor, params, index)
        if self.stale is not None:  # the same on every replica (a future of it on gloo)
            self.stale.reduced_now(tensor if tensor.is_cuda else done, self.group)
        if bucket.is_last():  # (this backward's buckets are all reduced: see _replays)
            self._backwards += 1
        return done

    def _reduce_stale(self, bucket: dist.GradBucket, tensor: torch.Tensor) -> torch.futures.Future:
        """Staleness 1: hand DDP the previous step's result of the bucket's parameters and start
        the reduction of a copy of this one ([Note: staleness 1 under DDP])."""
        params = bucket.parameters()
        slots = packed_slots(params)
        # first: the previous reductions of these parameters are then complete for this
        # stream, error feedback's residuals (written by them) included
        previous = self.stale.previous(slots, like=tensor)
        index, step, split = self._prepare(bucket, tensor, params)

        def launch(result: torch.Tensor, _keep) -> None:
            feedback = self._feedback(result)  # (made on the stream that fills it)
            self._all_reduce(result, split, step, index, feedback=feedback)
            self._keep_residuals(params, feedback)

        self.stale.send(
            launch,
            key=index,
            slots=slots,
            like=tensor,
            input=tensor.clone(),
            owner=self,
            in_place=True,
            local=tensor,
        )
        if previous is None:
            previous = torch.zeros_like(tensor)
        return self._checked(_completed(previous), previous, params, index)

    @property
    def _replays(self) -> bool:
        """Whether this bucket's reduction is replayed: graphs, and DDP's buckets final (a
        synchronous backward has reduced its last bucket before)."""
        return self.graphs is not None and self._backwards > 0

    def _feedback(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Error feedback: the buffer a reduction of ``tensor`` writes what it lost into."""
        if not self.error_feedback:
            return None
        return torch.empty(tensor.numel(), dtype=torch.float32, device=tensor.device)

    def _plan_for(self, index: int) -> qc.ReducePlan:
        if self.widths is None:
            return self.plan
        return self.plan.with_bits(self.widths.width(index))

    def _all_reduce(
        self,
        tensor: torch.Tensor,
        split,
        step: int,
        index: int,
        *,
        feedback=None,
        async_op=False,
        graphs=None,
    ) -> qc.CommWork | None:
        extra = {} if feedback is None else {"feedback": feedback}
        if graphs is not None:
            extra["graphs"] = graphs
        if self.second_group is not None:
            extra["second_group"] = self.second_group
        return self._plan_for(index).all_reduce(
            tensor,
            self.group,
            op="avg",
            split=split,
            seed=self.config.seed,
            step=step % 2**32,
            bucket=index,
            stats=self.stats,
            async_op=async_op,
            **extra,
        )

    def keep_local_gradients(self) -> None:
        """Staleness 1: keep this rank's own (unreduced) gradient of each bucket while its
        reduction is in flight, for ``WeightPrediction(optimizer, local=hook)``: each rank then
        predicts from its own, and the replicas compute at different points (restored after the
        backward, so they stay identical). Memory: one more gradient per rank."""
        if self.stale is None:
            raise ValueError("local gradient estimates are for staleness=1")
        self.stale.keep_local_gradients()

    def local_gradients(self, *, take: bool = False) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's share of this rank's own gradient of the step in flight, shaped as
        the parameter (an unbiased estimate of the averaged gradient the next backward
        applies); empty when nothing is in flight. ``take``: handed over, the hook keeps them
        no longer ([Note: estimates handed over] in ``qsdp.runtime.delayed``)."""
        if self.stale is None:
            raise ValueError("local gradient estimates are for staleness=1")
        return self.stale.local_gradients(take=take)

    def estimate_square_norm(self, estimates: dict) -> torch.Tensor:
        """The squared norm of one whole estimate: this rank's own (every rank holds a whole
        gradient). No collective."""
        return square_norm(estimates.values())

    def predict_with(self, optimizer: torch.optim.Optimizer) -> None:
        """Staleness 1 as shipped: predict ``optimizer``'s next step from now on. Call it after
        loading a checkpoint, whose first forward refuses to run unpredicted otherwise
        (:func:`qsdp.runtime.prediction.predict_with`)."""
        predict_with(self.predict, optimizer, what="hook")

    def drain(self) -> None:
        """Staleness 1, after the last backward: wait for the reductions still in flight and put
        them into the parameters' ``.grad`` (then call ``optimizer.step()`` once more); checked
        for NaN/Inf as every applied gradient. A no-op when nothing is in flight.

        Raises:
            ValueError: the config is synchronous (``staleness=0``), or a drained gradient is
                non-finite with ``nonfinite="raise"`` (on every rank: the result is the same).
        """
        if self.stale is None:
            raise ValueError("drain() is for staleness=1; a synchronous hook has nothing in flight")
        if self.predict is not None:  # the parameters as they are, not predicted
            self.predict.restore()
        self.check_nonfinite()  # the last backward's verdict first
        self.stale.drain()

    def check_applied(self, flat: torch.Tensor) -> None:
        """A drained result ([Note: one staleness core]): zeroed if it holds NaN/Inf, decided
        at once (the same bits on every rank: no agreement needed)."""
        if self.check is None:
            return
        bad = _flag_word(flat)
        _flag_and_zero(flat, bad)
        self.check.add(self._drained, bad)  # outside a backward

    @contextlib.contextmanager
    def synchronous(self) -> Iterator[None]:
        """Staleness 1: the backwards inside reduce and apply their gradients at once, as at
        staleness 0 (the step after the staleness gate fired; :meth:`drain` first). The step
        after such a backward applies nothing."""
        if self.stale is None:
            raise ValueError("synchronous() is for staleness=1; this hook is synchronous already")
        self.stale.synchronous = True
        try:
            yield
        finally:
            self.stale.synchronous = False

    def _checked(
        self,
        fut: torch.futures.Future,
        tensor: torch.Tensor,
        params: list[nn.Parameter],
        index: int,
    ) -> torch.futures.Future:
        """Flag and zero a non-finite result on the device; decided when the backward ends.

        On CUDA ``fut`` is complete already, its events recorded on the current (hook) stream:
        the flagging is queued there at once and a new future records it, no callback (a
        callback would take a stream from PyTorch's pool: [Note: a CUDA future without a
        callback] in ``qsdp.comm._common``). On gloo it runs in ``fut``'s callback."""
        replay = self._replays and self.check is not None and tensor.is_cuda
        flags = key = None
        if replay:  # the flagging replayed too, on a flag word of its own
            key = _flag_key(tensor)
            flags = self.graphs.buffers(key, lambda: _flag_word(tensor))
        elif self.check is not None:
            flags = _flag_word(tensor)

        def finish(_: torch.futures.Future | None = None) -> torch.Tensor:
            if flags is not None:
                _flag_and_zero(tensor, flags)
            return tensor

        if tensor.is_cuda:
            fut.wait()  # (complete: the current stream waits for its events, the host does not)
            if replay:  # (keyed by the bucket's memory: the graph writes where it lies)
                self.graphs.run(key, finish)
                done = _completed(tensor)
            else:
                done = _completed(finish())
        else:
            done = fut.then(finish)
        if flags is not None:
            report = self._reports.get(index)
            if report is None:
                report = self._reports[index] = _BucketReport(self._names)
            report.params = params  # (named only when a verdict reports it)
            self.check.add(report, flags, ready=done)
        return done

    # --- policy split and error feedback ------------------------------------------------------
    def _layout(self, params: list[nn.Parameter]) -> list[tuple[str, int, tuple[int, ...]]]:
        return [(self._names.get(id(p), ""), p.numel(), tuple(p.shape)) for p in params]

    def _split(self, index: int, params: list[nn.Parameter]) -> qc.Split | None:
        key = (index, tuple(id(p) for p in params))
        if key not in self._splits:
            policy = self.config.policy
            self._splits[key] = policy.split(self._layout(params)) if policy else None
        return self._splits[key]

    def _add_residuals(self, tensor: torch.Tensor, params: list[nn.Parameter]) -> None:
        """Error feedback: add each parameter's residual (what the last reduction of it lost,
        this rank's share) to its piece of the bucket. A non-finite residual (a bucket the
        NaN/Inf check zeroed) adds 0 there (zeroed in place in the feedback buffers the
        residuals view: they are read once)."""
        pieces = [(piece, self._residuals.get(name)) for name, piece in self._pieces(params)]
        pieces = [(piece, r) for piece, r in pieces if r is not None]
        if not pieces:
            return
        # the feedback buffers they view (a residual restored from a checkpoint is its own)
        bases = [r if r._base is None else r._base for _, r in pieces]
        buffers = {id(b): b for b in bases}
        for buffer in buffers.values():  # once each: a few ops per bucket, not per parameter
            buffer.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            if buffer.is_cuda:  # made on a hook stream, maybe another one (pipelined buckets)
                buffer.record_stream(torch.cuda.current_stream(buffer.device))
        (buffer,) = buffers.values() if len(buffers) == 1 else (None,)
        if (  # the same bucket as last step: one add of its whole feedback
            buffer is not None
            and len(pieces) == len(params)
            and buffer.numel() == tensor.numel()
            and all(r.storage_offset() - buffer.storage_offset() == p.start for p, r in pieces)
        ):
            tensor.add_(buffer)
            return
        torch._foreach_add_([tensor[piece] for piece, _ in pieces], [r for _, r in pieces])

    def _keep_residuals(self, params: list[nn.Parameter], feedback: torch.Tensor | None) -> None:
        """The reduction's ``feedback`` (filled when it completes) as the parameters' next
        residuals: views, read at their next reduction (after DDP waited for this one)."""
        if feedback is not None:
            for name, piece in self._pieces(params):
                self._residuals[name] = feedback[piece]

    def _pieces(self, params: list[nn.Parameter]) -> Iterator[tuple[str, slice]]:
        """Each parameter's name and its slice of a bucket of ``params``."""
        offset = 0
        for p in params:
            yield self._names.get(id(p), str(id(p))), slice(offset, offset + p.numel())
            offset += p.numel()

    # --- reports and checkpoints ------------------------------------------------------------
    def count_native(self, model: nn.Module) -> None:
        """Count DDP's own all-reduce of ``model`` (no comm hook: see [Note: the hook's own
        stream]): every parameter's gradient, once per backward that synchronises, counted
        when the first parameter's gradient is accumulated (one Python call per backward)."""
        params = [p for p in model.module.parameters() if p.requires_grad]
        self._native = sum(p.numel() * p.element_size() for p in params)
        name = self.plan.name

        def count(_: torch.Tensor) -> None:
            if model.require_backward_grad_sync:  # not inside no_sync()
                self.stats.count_call(name)
                self.stats.add_bytes(name, self._native)

        params[-1].register_post_accumulate_grad_hook(count)  # (DDP's first bucket holds it)

    def wire_bytes_per_step(self) -> int:
        """Bytes one step hands to ``torch.distributed`` by the ``*_wire_bytes`` rules, for the
        buckets of the latest step (DDP rebuilds them after the first)."""
        if self._native is not None:
            return self._native
        world = dist.get_world_size(self.group)
        return sum(
            self._plan_for(index).all_reduce_wire_bytes(
                numel, world, split=split, element_size=size
            )
            for index, (numel, size, split) in self._buckets.items()
        )

    @property
    def zeroed(self) -> int:
        """Bucket reductions zeroed for NaN/Inf so far, as read: each backward's count when the
        next one ends, or at :meth:`check_nonfinite`."""
        return self._drained.zeroed + sum(r.zeroed for r in self._reports.values())

    def check_nonfinite(self) -> None:
        """Read the NaN/Inf verdict of the last backward now (it is otherwise read when the
        next backward ends: [Note: the verdict read one backward later] in
        ``qsdp.runtime.nonfinite``): call on every rank after the last step, and before a
        checkpoint. A no-op with ``nonfinite="propagate"`` or nothing unread.

        Raises:
            ValueError: with ``nonfinite="raise"``, a bucket of that backward held NaN/Inf (on
                every rank; it was zeroed on the device then).
        """
        if self.check is not None:
            self.check.flush()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The noise counters (and error-feedback residuals): a resumed run draws the same
        noise as an uninterrupted one. Fixed shapes (``torch.distributed.checkpoint`` loads
        into the tensors a fresh hook's ``state_dict`` gives): one counter per possible bucket
        index, one residual per parameter. Reads the last backward's NaN/Inf verdict first
        (:meth:`check_nonfinite`)."""
        self.check_nonfinite()
        if self._calls and max(self._calls) >= _MAX_BUCKETS:
            raise ValueError(f"more than {_MAX_BUCKETS} DDP buckets: raise bucket_cap_mb")
        calls = torch.zeros(_MAX_BUCKETS, dtype=torch.int64)
        for index, n in self._calls.items():
            calls[index] = n
        state = {"recipe": config_record(self.config, self.schedule), "calls": calls}
        state["auto"] = auto.state_entry(self.decision)  # "auto"'s record (zeros: none)
        if self.widths is not None:
            state.update(self.widths.state_dict())
        if self.stale is not None:  # the reductions in flight (and each rank's estimates)
            state.update(self.stale.state_dict())
        if self.error_feedback:  # each rank's own residual: under its own keys, like the
            # estimates (one key for all would save rank 0's only: DCP keeps one copy of a
            # tensor every rank saves under the same name)
            rank = dist.get_rank(self.group)
            for name, p in self._params.items():
                r = self._residuals.get(name)
                r = r.view_as(p) if r is not None else torch.zeros_like(p.detach())
                state[f"residual.rank{rank}.{name}"] = r
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "recipe" in state:
            check_saved(
                state["recipe"], self.config, self.schedule, what="qsdp.ddp hook load_state_dict"
            )
        auto.check_state_entry(state.get("auto"), decision=self.decision, config=self.config)
        self._calls = {i: int(n) for i, n in enumerate(state["calls"].tolist()) if n}
        if self.widths is not None:
            self.widths.load_state_dict(state)
        if self.stale is not None:
            self.stale.load_state_dict(state)
            if self.predict is not None and self.stale.in_flight:  # [Note: a resumed prediction]
                self.predict.loaded = True
        mine = f"residual.rank{dist.get_rank(self.group)}."
        self._residuals = {
            k[len(mine) :]: v.reshape(-1).clone() for k, v in state.items() if k.startswith(mine)
        }


def _flag_word(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=tensor.device)


def _flag_and_zero(tensor: torch.Tensor, flags: torch.Tensor) -> None:
    """Zero a reduced bucket holding NaN/Inf and set its flag (on the device: no host read)."""
    # the same on every rank: they hold the same bits. One read of the bucket (no temporary of
    # its size, which a replay's memory pool would keep); written only where flagged
    nonfinite_flags(tensor, None, out=flags)
    zero_flagged(tensor, flags)


def _flag_key(tensor: torch.Tensor) -> tuple:
    """A replayed bucket check's key: the bucket's memory and the stream (the captured check
    reads and writes that memory; DDP keeps its buckets' buffers from step to step)."""
    stream = torch.cuda.current_stream(tensor.device).stream_id
    return ("ddp nonfinite", tensor.device, stream, tensor.data_ptr(), tensor.numel(), tensor.dtype)


def _completed(value: torch.Tensor) -> torch.futures.Future:
    """A future already holding ``value`` (on CUDA it records the current stream, which DDP's
    wait then follows)."""
    fut = torch.futures.Future(devices=[value.device] if value.is_cuda else None)
    fut.set_result(value)
    return fut


class _BucketReport:
    """What :class:`NonfiniteCheck` reports of one bucket reduction (its parameters): the
    bucket's latest parameters, named only when a verdict reports them (not at every call)."""

    layout = None

    def __init__(self, names: dict[int, str], *, where: str = "") -> None:
        self.module_name = ""
        self.zeroed = 0
        self.params: list[nn.Parameter] = []
        self._names, self._where = names, where

    @property
    def where(self) -> str:
        if self._where or not self.params:
            return self._where
        names = [self._names.get(id(p), "?") for p in self.params]
        more = " ..." if len(names) > 6 else ""
        return f"the DDP bucket holding {names[:6]}{more}"
