"""Shared plumbing of the collectives: groups, ops, noise streams, byte-counted torch.distributed
calls and the work handle that runs a collective's stages.

[Note: stages and async_op]
A collective is written as a generator of stages. It encodes, issues its ``torch.distributed``
calls with ``async_op=True`` and yields ``(works, deferrable)``: the works it must see finished
before it can go on. :class:`CommWork` drives it. A stage with ``deferrable=False`` is waited for
at once, so every ``torch.distributed`` call a collective makes is issued before the collective
returns, in program order, exactly like torch's own async collectives (ranks can never issue them
in different orders). Only the last stage is ``deferrable``: with ``async_op=True`` the handle
returns while it is in flight, and ``wait()`` finishes it and runs the local decode.

[Note: which stream an exchange runs on]
A collective driven to its end at once (``async_op=False``: FSDP2's hooks, every blocking call)
issues its exchanges with ``async_op=False`` as well, so NCCL enqueues them on the *current*
stream, as FSDP2's own collectives run: the all-gather on FSDP's all-gather stream, the
reduce-scatter on its reduce-scatter stream, each ordered after its encode by the stream alone.
Issued with ``async_op=True`` they all went to the process group's one internal NCCL stream,
where a module's weight all-gather queued behind the previous module's gradient exchange: the
two could never overlap, on NVLink or over sockets (profiled, 4x H200, `sdp4bit` NVLink: the
all-gather and the all-to-all on one stream, the compute stream idle 79 ms a step waiting for
the gathers). A deferred collective (``async_op=True``: DDP's hooks, staleness 1) still issues
on the group's stream, so its exchange overlaps what the current stream does next; so does a
stage that asks for it (``stream="group"``: the two-level reduce-scatter's pieces, whose intra-
and inter-node hops overlap each other on their two groups' streams).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator, Sequence

import torch
import torch.distributed as dist

from ..quant import QuantSpec, divide_into
from ._calls import before_exchange
from ._dist import dist_all_gather, dist_reduce_scatter
from ._split import Split, check_split
from ._stats import CommStats, comm_stats

Works = Sequence[dist.Work]
Stages = Generator[tuple[Works, bool], None, None]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MASK64 = (1 << 64) - 1
# Philox streams 0xFFFFFFFE/0xFFFFFFFF are reserved by qsdp.quant (lattice dither, Hadamard signs).
_STREAMS = 0xFFFFFFF0


class _Issue(threading.local):
    """Whether the exchanges issued now go on the current stream (a synchronous drive)."""

    on_current_stream = False


_issue = _Issue()


class _Enqueued:
    """The ``dist.Work`` of an exchange issued with ``async_op=False``: enqueued on the current
    stream (NCCL) or finished (gloo), so there is nothing to wait for."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


ENQUEUED = _Enqueued()


def start(call: Callable[..., dist.Work | None], *args, stream: str = "drive", **kwargs):
    """Issue the ``torch.distributed`` ``call`` ([Note: which stream an exchange runs on]).
    ``stream``: ``"drive"`` on the current stream while the collective is driven synchronously,
    else async on the group's stream; ``"current"`` always on the current stream (the caller
    waits at once); ``"group"`` always async on the group's stream. An exchange issued on the
    current stream returns :data:`ENQUEUED`."""
    if stream == "current" or (stream == "drive" and _issue.on_current_stream):
        call(*args, async_op=False, **kwargs)
        return ENQUEUED
    if stream not in ("drive", "group"):
        raise ValueError(f"stream={stream!r} must be 'drive', 'current' or 'group'")
    return call(*args, async_op=True, **kwargs)


class CommWork:
    """Handle of a collective started with ``async_op=True``.

    ``wait()`` blocks until the communication has finished and the result is in the output
    tensor. Every ``torch.distributed`` call of the collective was issued before the call that
    returned this handle came back, so ranks may wait in any order.
    """

    def __init__(self, stages: Stages, *, defer: bool, result: torch.Tensor | None = None) -> None:
        self._stages = stages
        self._pending: Works | None = None
        self._done = False
        self._result = result
        self._sync = not defer  # issue on the current stream ([Note: which stream ...])
        self._run(defer=defer)

    def _run(self, *, defer: bool) -> None:
        outer = _issue.on_current_stream
        _issue.on_current_stream = self._sync
        try:
            for works, deferrable in self._stages:
                if defer and deferrable:
                    self._pending = works
                    return
                for w in works:
                    w.wait()
            self._done = True
        finally:
            _issue.on_current_stream = outer

    def wait(self) -> bool:
        """Finish the collective (wait for its last communication, decode). Returns True."""
        if not self._done:
            for w in self._pending or ():
                w.wait()
            self._pending = None
            self._run(defer=False)
        return True

    def is_completed(self) -> bool:
        """True when ``wait()`` would not block on communication (it may still decode)."""
        return self._done or all(w.is_completed() for w in self._pending or ())

    def get_future(self) -> torch.futures.Future:
        """A future that completes with the collective's result tensor once it is decoded
        (what a DDP comm hook returns).

        On CUDA the decode is queued at once on the current stream, after a stream wait for
        every exchange (the host does not block), and the future is a CUDA-aware one holding
        the result, which records that stream: whoever waits on it waits for the decode. On
        gloo the decode runs in a callback once every exchange has finished.
        """
        on_cuda = self._result is not None and self._result.is_cuda
        if on_cuda or self._done or not self._pending:
            # [Note: a CUDA future without a callback]
            # The result must come as a CUDA-aware future (DDP waits on it through stream
            # events). It used to be a callback chained on an NCCL work's future (``then``):
            # that future is marked complete when the collective is queued, so the callback
            # ran at once, but on a stream of its own that CUDA futures take from PyTorch's
            # stream pool, a new one per callback, round-robin over the pool's 32 streams, the
            # same pool ``torch.cuda.Stream()`` and the communicators' streams come from. Sooner
            # or later the callback's stream was a hook stream, and that stream first waited
            # for the bucket's exchange: whatever was queued there next (the next bucket's
            # scales and codes) waited for it too (profiled, 4x H200 over sockets, DDP
            # `global-qsgd` pipelined: the last bucket's MAX of scales ran only once the third
            # bucket's SUM had ended, 30 ms after the host queued it). Now nothing takes a
            # stream: ``Work.wait`` makes the current stream (the one the collective allocated
            # its buffers on, so freed buffers return to its pool) wait for every exchange, the
            # decode is queued behind, and the future records the current stream.
            self.wait()
            fut: torch.futures.Future = torch.futures.Future(
                devices=[self._result.device] if on_cuda else None
            )
            fut.set_result(self._result)
            return fut
        works = list(self._pending)

        def finish_host(_: torch.futures.Future) -> torch.Tensor | None:
            self._pending = None
            self._run(defer=False)
            return self._result

        futs = [w.get_future() for w in works]
        both = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
        return both.then(finish_host)


def run_stages(
    stages: Stages, async_op: bool, result: torch.Tensor | None = None
) -> CommWork | None:
    """Drive a collective's stages: to the end, or up to its deferrable stage for async_op.
    ``result`` is the tensor the collective writes (what ``CommWork.get_future`` yields)."""
    work = CommWork(stages, defer=async_op, result=result)
    return work if async_op else None


def with_raw_part(
    comp_stages: Stages,
    issue_raw: Callable[[], dist.Work],
    finish: Callable[[], None],
) -> Stages:
    """Stages of a collective whose policy split's raw part goes in a second, plain
    ``torch.distributed`` call (where codes and raw values cannot share one, e.g. an integer
    carrier): ``issue_raw`` starts it beside the codes' last exchange (after any NaN/Inf
    verdict, in the same program order on every rank), ``finish`` puts the parts together."""
    raw = None
    for works, deferrable in comp_stages:
        if deferrable:
            raw = issue_raw()
            yield [*works, raw], True
        else:
            yield works, False
    if raw is None:  # the codes needed no exchange (an empty part)
        yield [issue_raw()], True
    finish()


def all_reduce_split(
    tensor: torch.Tensor,
    split: Split,
    run: Callable[[torch.Tensor], Stages],
    group,
    op: str,
    stats: CommStats,
    name: str,
) -> Stages:
    """Stages of an all-reduce of ``tensor`` in place whose policy ``split``'s compressed part
    runs ``run(comp)`` and whose raw part a plain SUM all-reduce (see :func:`with_raw_part`)."""
    check_split(split, tensor.numel(), "the tensor")
    comp, raw = split.take(tensor.view(1, -1))
    comp, raw = comp.view(-1), raw.view(-1)

    def finish() -> None:
        if op == "avg":
            raw.div_(dist.get_world_size(group))
        split.put(tensor.view(1, -1), comp.view(1, -1), raw.view(1, -1))

    return with_raw_part(
        run(comp), lambda: all_reduce(raw, dist.ReduceOp.SUM, group, stats, name), finish
    )


# --- arguments ----------------------------------------------------------------------------------
def group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """(group, its size, this process's rank in it); ``None`` is the default group."""
    if not dist.is_initialized():
        raise RuntimeError(
            "qsdp.comm collectives need torch.distributed: call dist.init_process_group first"
        )
    if isinstance(group, dist.ProcessGroup):  # (a member's group: no lookup, a hot path)
        return group, group.size(), group.rank()
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return pg, dist.get_world_size(pg), rank


def second_group(second: dist.ProcessGroup | None, pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """The communicator of an all-reduce's later exchange: ``second``, checked to hold ``pg``'s
    ranks in ``pg``'s order (the same check on every rank: every rank raises, or none), or
    ``pg`` itself when None. See [Note: two communicators] in ``_two_phase.py``."""
    if second is None:
        return pg
    if (pg, second) in _SAME_RANKS:  # (checked once per pair: a hot path, every DDP bucket)
        return second
    mine, theirs = dist.get_process_group_ranks(pg), dist.get_process_group_ranks(second)
    if mine != theirs:
        raise ValueError(
            f"second_group holds the ranks {theirs}, the all-reduce's group {mine}: the later "
            "exchange must run over the same ranks in the same order; make it with "
            "dist.new_group(dist.get_process_group_ranks(group))"
        )
    _SAME_RANKS.add((pg, second))
    return second


#: (group, second group) pairs found to hold the same ranks in the same order
_SAME_RANKS: set[tuple[dist.ProcessGroup, dist.ProcessGroup]] = set()


def parse_op(op: str | dist.ReduceOp) -> str:
    """``"avg"`` or ``"sum"`` from a string or ``dist.ReduceOp.AVG`` / ``SUM``."""
    if isinstance(op, str) and op.lower() in ("avg", "sum"):
        return op.lower()
    if not isinstance(op, str):
        if op == dist.ReduceOp.AVG:
            return "avg"
        if op == dist.ReduceOp.SUM:
            return "sum"
    raise ValueError(
        f"op={op!r} is not supported: qsdp reduces with 'avg' or 'sum' (ReduceOp.AVG / SUM); for "
        "a pre-scaled sum (PREMUL_SUM) scale the input and pass op='sum'"
    )


def check_spec(spec: object, name: str = "spec") -> QuantSpec:
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name} must be a qsdp.quant.QuantSpec, got {type(spec).__name__}")
    return spec


def check_float(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; qsdp's collectives take float32, bfloat16 or float16"
        )
    return t


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (it is written in place); got {tuple(t.shape)=} "
            f"{t.stride()=}; pass {name}.contiguous() and copy back"
        )


def check_same_device(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{names} must be on one device; got {a.device} and {b.device}")


def check_key(seed: int, step: int, bucket: int) -> None:
    for name, value, bits in (("seed", seed, 64), ("step", step, 32), ("bucket", bucket, 32)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**bits:
            raise ValueError(f"{name}={value!r} must be an int in [0, 2**{bits})")


# --- NaN/Inf: one verdict for all ranks ---------------------------------------------------------
# [Note: NaN/Inf in a collective]
# An encode that raised on one rank would leave its peers waiting in the exchange until the
# process group's timeout. So a collective encodes with ``spec.propagating()`` (flagged groups
# travel as NaN) and, when the caller's spec says ``"raise"``, counts the flagged groups of its
# own payloads (plus NaN/Inf in any part it sends unquantized) on the device and calls
# :func:`agree_finite` before its first exchange: one small all-reduce, after which every rank
# raises the same error, or none does.


def agree_finite(
    bad: torch.Tensor, groups: Sequence[dist.ProcessGroup], stats: CommStats, name: str
) -> None:
    """Raise on every rank if any rank's count ``bad`` (a device scalar) is nonzero.

    ``groups``: the collective's group, or the rows then the columns of a 2-D mesh (summing
    over both reaches every rank). One SUM all-reduce per group of ``world + 1`` int64 (which
    global ranks, how many), counted under ``"nonfinite_check"``, and one host read; see
    [Note: NaN/Inf in a collective].
    """
    n = dist.get_world_size()
    flags = torch.zeros(n + 1, dtype=torch.int64, device=bad.device)
    flags[dist.get_rank()] = (bad > 0).to(torch.int64)
    flags[n] = bad
    for group in groups:
        before_exchange(group)
        stats.add_bytes("nonfinite_check", _nbytes(flags))
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    host = flags.tolist()
    if host[n]:
        ranks = [j for j in range(n) if host[j]]
        raise ValueError(
            f"qsdp.comm.{name}: {host[n]} groups or values hold NaN/Inf (or values too large for "
            f"the quantizer) on ranks {ranks}; every rank raises, nothing was "
            "exchanged. Fix the source (a diverging loss, a missing grad clip or loss scale), or "
            "build the QuantSpec with nonfinite='propagate' to send such groups as NaN"
        )


# --- noise streams ------------------------------------------------------------------------------
def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words with good avalanche."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def noise_rank(group: dist.ProcessGroup | None) -> int:
    """The ``rank`` of :func:`noise_stream` for this process's encodes in a collective over
    ``group``: its place in the group.

    [Note: noise per place in the group]
    Stochastic rounding must draw independent noise for the ranks whose codes are summed: the
    ranks of the collective's group, told apart by their place in it. The global rank would also
    tell apart ranks that must draw the *same* noise: under tensor parallelism the TP peers of a
    data-parallel rank hold the same replicated parameters (norms, embeddings), reduce the same
    gradients and gather the same weights over their own data-parallel groups, and must end with
    the same bits (with noise keyed by the global rank their replicas drifted apart, issue 31).
    Groups whose codes are never summed together (the shard groups of two HSDP replicas) may
    draw alike; where their results are later averaged (native HSDP's replicate all-reduce),
    the integration keys them apart through the seed (:func:`replica_seed`).
    """
    return dist.get_rank() if group is None else group.rank()  # (no lookup: a hot path)


def replica_seed(seed: int, replica: int) -> int:
    """The noise seed of replica ``replica`` of a data-parallel layout whose replicas reduce
    over groups of their own and are averaged later (native HSDP): distinct per replica, equal
    to ``seed`` for replica 0 ([Note: noise per place in the group])."""
    return seed if replica == 0 else _mix64((seed + replica * 0xD1B54A32D192ED03) & _MASK64)


@functools.lru_cache(maxsize=65536)
def noise_stream(rank: int, chunk: int, *, bucket: int = 0, hop: int = 0, piece: int = 0) -> int:
    """Philox ``stream`` word of one encode: distinct per (bucket, hop, rank, chunk, piece), with
    ``rank`` the encoder's place in the collective's group (:func:`noise_rank`).

    Stochastic rounding must draw independent noise on every rank (shared noise correlates the
    errors and breaks the 1/n variance of the mean) and for every chunk a rank encodes (each
    encode numbers its elements from 0). The tuple is hashed to 32 bits, avoiding the streams
    ``qsdp.quant`` reserves.
    """
    z = 0
    for word in (bucket, hop, rank, chunk, piece):
        z = _mix64((z + word + 0x9E3779B97F4A7C15) & _MASK64)
    return z % _STREAMS


@functools.lru_cache(maxsize=4096)
def peer_streams(rank: int, n: int, *, bucket: int = 0, hop: int = 0) -> tuple[int, ...]:
    """:func:`noise_stream` of ``rank``'s encodes of every chunk ``j != rank`` of ``n``, in
    ``j`` order: a reduce-scatter's ``n - 1`` encodes (worked out once per key)."""
    return tuple(noise_stream(rank, j, bucket=bucket, hop=hop) for j in range(n) if j != rank)


# --- torch.distributed calls, counted -----------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats, name: str, *, stream="drive"
) -> dist.Work:
    """``all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor``, counted, issued by
    :func:`start` on ``stream``."""
    before_exchange(group)
    stats.add_bytes(name, _nbytes(inp))
    return start(dist_all_gather(), out, inp, group=group, stream=stream)


def reduce_scatter_sum(
    out: torch.Tensor,
    inp: torch.Tensor,
    group,
    stats: CommStats,
    name: str,
    *,
    stream: str = "drive",
) -> dist.Work:
    """``reduce_scatter_single`` (torch >= 2.13) or ``reduce_scatter_tensor`` with SUM, issued
    by :func:`start` on ``stream``; counts the ``n - 1`` chunks bound for the peers (the own
    chunk never leaves, see ``_stats``)."""
    before_exchange(group)
    stats.add_bytes(name, _nbytes(inp) - _nbytes(out))
    return start(dist_reduce_scatter(), out, inp, op=dist.ReduceOp.SUM, group=group, stream=stream)


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    stats: CommStats,
    name: str,
    *,
    stream: str = "drive",
) -> dist.Work:
    """``all_to_all_single`` with explicit (possibly uneven) splits, counted, issued by
    :func:`start` on ``stream``."""
    stats.add_bytes(name, _nbytes(inp))
    before_exchange(group)
    return start(
        dist.all_to_all_single, out, inp, out_splits, in_splits, group=group, stream=stream
    )


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group, stats: CommStats, name: str) -> dist.Work:
    """``all_reduce`` in place, counted, issued by :func:`start`."""
    stats.add_bytes(name, _nbytes(t))
    before_exchange(group)
    return start(dist.all_reduce, t, op=op, group=group)


def resolve_stats(stats: CommStats | None) -> CommStats:
    if stats is None:
        return comm_stats
    if not isinstance(stats, CommStats):
        raise TypeError(f"stats must be a qsdp.comm.CommStats or None, got {type(stats).__name__}")
    return stats


def finish_into(out: torch.Tensor, acc: torch.Tensor, op: str, divisor: int) -> None:
    """Write the float32 sum ``acc`` into ``out`` (its dtype), divided for ``op='avg'``: one
    kernel (the division computes in float32 and casts as it writes ``out``, the bits of a
    division in place then a copy); ``acc`` is left as it was."""
    if op == "avg":
        divide_into(out.view(-1), acc, divisor)
    else:
        out.view(-1).copy_(acc)
