"""CGX's two-phase compressed all-reduce: quantized reduce-scatter, then quantized all-gather.

Phase 1 is :func:`~qsdp.comm.reduce_scatter` over ``n`` chunks (the input padded with zeros to
``n * ceil(numel / n)`` elements); rank ``r`` then owns the reduced chunk ``r``. Phase 2 is
:func:`~qsdp.comm.all_gather` of the owners' re-encoded chunks; every rank, the owner included,
decodes every chunk, so all ranks end with bit-identical tensors.

[Note: a split in two phases]
With a policy split the raw elements ride in the same two calls as the codes, as in the FSDP
collectives: the compressed part and the raw part are each cut into ``n`` chunks and chunk
``j`` of both forms row ``j`` of an ``n x (mc + mr)`` buffer, so that every row has the same
``[mc compressed | mr raw]`` layout; phase 1 is the fused reduce-scatter of those rows (the raw
values summed exactly in float32 on the owner), phase 2 the fused all-gather of the owner's row.
One all-to-all and one all-gather per call, as without a split (a third, plain all-reduce of
the raw part cost a collective's latency per DDP bucket).

[Note: exact error feedback]
With ``op="avg"`` the result is ``(1/n) sum_i (x_i - l_i) - o``: ``l_i`` is what rank ``i``'s
phase-1 encodes lost of its input (chunk ``j`` minus the decode of the payload it sent to ``j``;
its own chunk is summed exact), ``o`` what the owners' phase-2 encodes lost of the mean (zero
outside each owner's chunk). ``feedback=`` gives rank ``i`` ``f_i = l_i + n * o_i`` (``o_i``: the
part of ``o`` on the chunk it owns), so that ``(1/n) sum_i f_i`` is exactly the result's error:
adding ``f_i`` to the next call's input (EF-SGD) re-sends every loss of both phases, and over
``T`` calls the results sum to the exact sums minus the last call's ``(1/n) sum_i f_i``
(tested). It costs one decode of what each rank sends; nothing more crosses the wire. The losses
are of the encodes that ran, with their noise: a second encode to estimate them (another noise
draw, groups cut elsewhere) would add its own error instead of returning the first's.

[Note: two communicators]
NCCL runs one communicator's collectives one after another. A DDP backward all-reduces bucket
after bucket, so on one communicator bucket ``k``'s all-gather and bucket ``k + 1``'s all-to-all
queue behind each other although the link is full duplex (over sockets, an all-gather and an
all-to-all on two communicators took 0.215 s together where they took 0.135 s and 0.181 s
alone, 4x H200). ``second_group=`` runs phase 2 on a second communicator over the same ranks
(as it runs Global-QSGD's SUM after the MAX of its scales, ``integer_all_reduce``); the caller
must also keep consecutive calls off one CUDA stream (each call's decode waits for its last
exchange on the stream it runs on: ``qsdp.ddp`` alternates two). The bytes, the noise keys and
the result are those of one communicator.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..quant import Backend, QuantSpec
from . import _common as C
from ._all_gather import _all_gather_stages, all_gather_wire_bytes
from ._all_gather import replayed_site as replayed_all_gather
from ._calls import checked
from ._graphs import CodecGraphs, ReplayedSite, check_replayable
from ._reduce_scatter import _reduce_scatter_stages, reduce_scatter_wire_bytes
from ._reduce_scatter import replayed_site as replayed_reduce_scatter
from ._split import Split, check_split
from ._stats import CommStats

__all__ = ["two_phase_all_reduce", "two_phase_all_reduce_wire_bytes"]

_NAME = "two_phase_all_reduce"


def two_phase_all_reduce_wire_bytes(
    numel: int,
    world_size: int,
    spec: QuantSpec,
    *,
    split: Split | None = None,
    element_size: int = 4,
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`two_phase_all_reduce`.

    Returns:
        ``world_size * spec.payload_bytes(m)`` with ``m = ceil(numel / world_size)``:
        ``world_size - 1`` payloads in the all-to-all, one in the all-gather (the uncompressed
        all-reduce hands over ``numel * element_size``); with a split, ``world_size - 1``
        ``[codes | raw]`` rows of the chunked split in the all-to-all (raw elements of
        ``element_size`` bytes) and one in the all-gather (raw float32, the owner's sum), see
        [Note: a split in two phases].
    """
    if split is not None:
        per_chunk, _ = _chunked(split, world_size)
        rs = reduce_scatter_wire_bytes(
            per_chunk.chunk * world_size,
            world_size,
            spec,
            split=per_chunk,
            element_size=element_size,
        )
        return rs + all_gather_wire_bytes(per_chunk.chunk, spec, split=per_chunk, element_size=4)
    m = -(-numel // world_size)
    return world_size * spec.payload_bytes(m)


@checked("two_phase_all_reduce")
def two_phase_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    spec: QuantSpec,
    split: Split | None = None,
    op: str | dist.ReduceOp = "avg",
    async_op: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    backend: Backend = "auto",
    stats: CommStats | None = None,
    feedback: torch.Tensor | None = None,
    second_group: dist.ProcessGroup | None = None,
    graphs: CodecGraphs | None = None,
) -> C.CommWork | None:
    """All-reduce ``tensor`` in place through a quantized reduce-scatter and all-gather (CGX SRA).

    Error bound (per element, against the exact float64 reduction): the reduce-scatter's
    (``sum_{j != owner} step_j / 2`` for nearest rounding, ``< sum step_j`` stochastic, over the
    ranks that sent the element's chunk) plus one all-gather step of the reduced chunk
    (``step_owner / 2`` nearest, ``< step_owner`` stochastic), all divided by ``n`` for
    ``op="avg"`` except the last, which is taken on the already divided mean. Stochastic
    rounding keeps it unbiased. The result is bit-identical on all ranks.

    Args:
        tensor: float32/bf16/fp16, contiguous, any length; overwritten with the result.
        group: the process group (default: the world).
        spec: the quantizer of both phases, the same on every rank.
        split: which runs of ``tensor`` travel raw (see [Note: policies inside flat buffers]):
            summed by a second, plain all-reduce in ``tensor``'s dtype.
        op: ``"avg"`` (default) or ``"sum"``, or ``dist.ReduceOp.AVG`` / ``SUM``.
        async_op: return a :class:`CommWork`; the reduce-scatter completes before the call
            returns, the all-gather is in flight until ``wait()``. Leave ``tensor`` alone until
            then.
        seed, step: key of the stochastic-rounding noise, the same on every rank; both phases
            and every rank draw their own streams (from the global rank and ``bucket``).
        bucket: separates buffers reduced in the same step.
        backend: the quantizer backend (``"auto"``: Triton on CUDA, reference on CPU).
        stats: the byte counter to record into (default :data:`qsdp.comm.comm_stats`).
        feedback: float32, ``tensor``'s size, filled (by ``wait()``) with what this rank adds to
            its next input for error feedback: see [Note: exact error feedback].
        second_group: run phase 2 on this communicator, over the same ranks as ``group`` in
            the same order (default: ``group``), so that consecutive calls pipeline: one call's
            all-gather beside the next call's all-to-all (see [Note: two communicators]).
            The result is the same bits either way.
        graphs: replay both phases' encodes and decodes from CUDA graphs captured in it at the
            first call of each shape and noise key, the same bits ([Note: two phases
            replayed]): a synchronous call, a ``spec`` with ``nonfinite="propagate"``, the
            Triton backend, no ``feedback``.

    Returns:
        A :class:`CommWork` when ``async_op``, else None.
    """
    C.check_spec(spec)
    C.check_float(tensor, "tensor")
    C.check_contiguous(tensor, "tensor")
    op = C.parse_op(op)
    C.check_key(seed, step, bucket)
    pg, n, r = C.group_info(group)
    stats = C.resolve_stats(stats)
    stats.count_call(_NAME)
    if feedback is not None:
        if feedback.dtype != torch.float32 or feedback.numel() != tensor.numel():
            raise ValueError(
                f"feedback must be float32 with the tensor's {tensor.numel()} elements; got "
                f"{feedback.dtype} with {feedback.numel()}"
            )
        C.check_contiguous(feedback, "feedback")
        C.check_same_device(feedback, tensor, "feedback and tensor")
    owner = _Owner(r, n if op == "avg" else 1, feedback)
    pgs = (pg, C.second_group(second_group, pg))
    if split is not None:
        check_split(split, tensor.numel(), "the tensor")
    if graphs is not None:
        check_replayable(_NAME, async_op=async_op, spec=spec, backend=backend)
        if feedback is not None:
            raise ValueError(
                "two_phase_all_reduce(graphs=...) replays the codecs; error feedback's losses "
                "are computed eagerly: pass feedback=None or graphs=None"
            )
        site = graphs.site(
            _NAME,
            group=pg,
            input=tensor,
            output=tensor,
            layout=(spec, split, op, pgs[1]),
            noise=(seed, bucket),
            make=lambda key: _ReplayedPhases(
                graphs, key, tensor, split, pgs, n, op, spec, seed, bucket, backend
            ),
        )
        site.run(tensor, step, stats)
        return None
    if split is not None:
        stages = _split_phases(
            tensor, split, pgs, n, op, spec, seed, step, bucket, backend, stats, owner
        )
        return C.run_stages(stages, async_op, result=tensor)
    stages = _phases(tensor, pgs, n, op, spec, seed, step, bucket, backend, stats, owner)
    return C.run_stages(stages, async_op, result=tensor)


class _ReplayedPhases:
    """One call site of a replayed two-phase all-reduce (a DDP bucket's hook at one width).

    [Note: two phases replayed]
    Phase 1 is a replayed reduce-scatter's site, phase 2 a replayed all-gather's
    ([Note: codec segments replayed] in ``_graphs.py``), with the noise (``hop`` 0 and 1) and
    byte counter (``two_phase_all_reduce``) of the eager call, so the same bits and bytes. A
    call copies the tensor into the site's rows (a split's runs into their places; the rows'
    gaps zero since the rows were made, shared by the sites of one shape and stream), runs the
    two sites back to back and copies the gathered rows back: phase 1's encode, its exchange,
    one segment of phase 1's decode, the copy of its output into phase 2's input and phase 2's
    encode, phase 2's exchange and its decode: the two copies, three replays and two exchanges,
    about a dozen torch ops where the eager call issues some 60 and a dozen launches (DDP,
    ``benchmarks/host_per_step.py --ddp``). A tensor of whole chunks without a split is its own
    rows: phase 1 takes it and phase 2 writes it straight (two copies and a buffer fewer).
    Memory per shape and stream: the rows, phase 1's rows (or a split's parts) and output,
    phase 2's input and output, and the payloads: about three tensors' worth (float32 tensors;
    more for bf16 ones, whose phase outputs are float32)."""

    def __init__(self, graphs, key, tensor, split, pgs, n, op, spec, seed, bucket, backend) -> None:
        numel, device = tensor.numel(), tensor.device
        if split is not None:
            per_chunk, self.pieces = _chunked(split, n)
            chunk, gathered_dtype = per_chunk.chunk, torch.float32
        else:  # (padded inside to whole chunks, the gather decoded in the tensor's dtype)
            per_chunk, self.pieces = None, None
            chunk, gathered_dtype = -(-numel // n), tensor.dtype
        # whole chunks without a split: the tensor is the rows phase 1 reads; else the rows: a
        # split's pieces or the padded tensor, gaps and padding zero (shared by the sites of one
        # shape and stream, as the phases' own buffers are)
        self.direct = split is None and numel == n * chunk
        rows = tensor.view(-1)
        if not self.direct:
            rows = graphs.buffers(
                ("two_phase rows", key),
                lambda: torch.zeros(n * chunk, dtype=tensor.dtype, device=device),
            )
        kw = dict(split=per_chunk, seed=seed, bucket=bucket, backend=backend, name=_NAME)
        reduced = torch.empty(chunk, dtype=torch.float32, device=device)
        gathered = torch.empty(n * chunk, dtype=gathered_dtype, device=device)
        phase1 = replayed_reduce_scatter(
            graphs, reduced, rows, pgs[0], spec=spec, op=op, hop=0, **kw
        )
        phase2 = replayed_all_gather(graphs, gathered, reduced, pgs[1], spec=spec, hop=1, **kw)
        self.phases = _Phases(graphs, phase1, phase2)
        self.rows = None if self.direct else rows  # (the site holds no caller's tensor)
        # (made once: the views a call copies into and out of)
        out = phase2.out.view(-1)
        if split is not None:
            self._rows_parts, self._out_parts = self.pieces.parts(rows), self.pieces.parts(out)
        elif not self.direct:
            self._rows_head, self._out_head = rows[:numel], out[:numel]

    def run(self, tensor: torch.Tensor, step: int, stats: CommStats) -> None:
        flat = tensor.view(-1)
        if self.direct:  # phase 1 takes the tensor, phase 2 writes it
            self.phases.run(flat, flat, step, stats, _NAME, count_call=False)
            return
        if self.pieces is not None:
            flat_parts = list(flat.split(self.pieces.flat_sizes))
            torch._foreach_copy_(self._rows_parts, flat_parts)
        else:
            self._rows_head.copy_(flat)
        self.phases.run(None, self.rows, step, stats, _NAME, count_call=False)
        if self.pieces is not None:
            torch._foreach_copy_(flat_parts, self._out_parts)
        else:
            flat.copy_(self._out_head)


class _Phases(ReplayedSite):
    """Both phases as one replayed call of two hops ([Note: two phases replayed]): phase 1's
    input, encode and exchange; one segment of phase 1's decode, phase 2's step word and input
    (copied on the device from phase 1's) and phase 2's encode, then phase 2's exchange; phase
    2's decode, its output the call's. Three replays where the two sites' own runs took four,
    no copy between them on the host's account."""

    def __init__(self, graphs: CodecGraphs, phase1: ReplayedSite, phase2: ReplayedSite) -> None:
        super().__init__(graphs, (), (), inp=None, out=phase2.out, step=phase1.step)
        self.phase1, self.phase2 = phase1, phase2
        self.encode_key, self.decode_key = phase1.encode_key, phase2.decode_key
        # (per pair of sites: the encode's noise is phase 2's site's)
        middle = ("two_phase middle", phase1.decode_key, phase2.encode_key)
        self.hops = ((middle, self._middle, phase2.exchange),)

    def take(self, input: torch.Tensor) -> None:
        self.phase1.take(input)

    def encode(self) -> None:
        self.phase1.encode()

    def exchange(self, stats: CommStats) -> None:
        self.phase1.exchange(stats)

    def _middle(self) -> None:
        p1, p2 = self.phase1, self.phase2
        p1.decode()
        p2.step.copy_(p1.step)
        p2.take(p1.out)
        p2.encode()

    def decode(self) -> None:
        self.phase2.decode()


class _Owner(NamedTuple):
    """This rank's place in the call, for error feedback (``feedback`` None: none)."""

    rank: int
    scale: int  # n for "avg": the owner's loss is of the mean, its input is summed
    feedback: torch.Tensor | None


class _Pieces(NamedTuple):
    """Where a split tensor's runs go in the flat ``n x (mc + mr)`` rows, as two cuts made once
    ([Note: a split's plan] in ``_split.py``): the tensor cut into its pieces in order
    (``flat_sizes``), the rows cut at every piece's start and end (``rows_sizes``, the gaps
    between pieces included), and which of the rows' parts each piece is (``rows_index``)."""

    flat_sizes: tuple[int, ...]
    rows_sizes: tuple[int, ...]
    rows_index: tuple[int, ...]

    def views(
        self, flat: torch.Tensor, rows: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``flat``'s pieces and, in the same order, the parts of ``rows`` they go to."""
        return list(flat.split(self.flat_sizes)), self.parts(rows)

    def parts(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The parts of ``rows`` the tensor's pieces go to, in the pieces' order."""
        parts = rows.split(self.rows_sizes)
        return [parts[i] for i in self.rows_index]


@functools.lru_cache(maxsize=1024)
def _chunked(split: Split, n: int) -> tuple[Split, _Pieces]:
    """The ``[mc compressed | mr raw]`` split of each of the ``n`` rows, and where the tensor's
    runs go in the flat ``n x (mc + mr)`` rows: ``(tensor start, rows start, length)`` pieces,
    cut at row ends (see [Note: a split in two phases]), as :class:`_Pieces`. Cached: DDP hands
    the same layouts every step."""
    mc, mr = -(-split.n_comp // n), -(-split.n_raw // n)
    runs = tuple(run for run in ((0, mc, True), (mc, mr, False)) if run[1] > 0)
    per_chunk = Split(chunk=mc + mr, runs=runs, raw_names=split.raw_names)
    pieces, seen = [], {True: 0, False: 0}
    for start, length, compressed in split.runs:
        width, col0 = (mc, 0) if compressed else (mr, mc)
        k, end = seen[compressed], seen[compressed] + length
        while k < end:  # element k of its part sits in row k // width, column k % width
            take = min(end - k, width - k % width)
            pieces.append(
                (start + k - seen[compressed], (k // width) * (mc + mr) + col0 + k % width, take)
            )
            k += take
        seen[compressed] = end
    # the tensor's pieces follow each other; in the rows they lie in another order, with gaps
    rows_sizes, rows_index, at = [], [0] * len(pieces), 0
    for i in sorted(range(len(pieces)), key=lambda i: pieces[i][1]):
        _, d, k = pieces[i]
        if d > at:
            rows_sizes.append(d - at)
        rows_index[i] = len(rows_sizes)
        rows_sizes.append(k)
        at = d + k
    if n * (mc + mr) > at:
        rows_sizes.append(n * (mc + mr) - at)
    layout = _Pieces(tuple(k for _, _, k in pieces), tuple(rows_sizes), tuple(rows_index))
    return per_chunk, layout


def _stage_args(spec, seed, step, bucket, backend, stats, split=None) -> dict:
    """The keyword arguments both phases' stages share."""
    return dict(
        spec=spec,
        seed=seed,
        step=step,
        bucket=bucket,
        backend=backend,
        stats=stats,
        name=_NAME,
        count_call=False,
        split=split,
    )


def _split_phases(
    tensor, split, pgs, n, op, spec, seed, step, bucket, backend, stats, owner
) -> C.Stages:
    """Both phases with the raw part in the same calls (``pgs``: phase 1's group and phase
    2's); the first's encodes run before this returns."""
    per_chunk, pieces = _chunked(split, n)
    flat = tensor.view(-1)
    rows = torch.zeros(n * per_chunk.chunk, dtype=tensor.dtype, device=tensor.device)
    sources, targets = pieces.views(flat, rows)
    torch._foreach_copy_(targets, sources)
    common = _stage_args(spec, seed, step, bucket, backend, stats, split=per_chunk)
    reduced = torch.empty(per_chunk.chunk, dtype=torch.float32, device=tensor.device)
    lost = None if owner.feedback is None else torch.empty_like(rows, dtype=torch.float32)
    # (rows is this call's own: nothing writes it before phase 1 decodes, keep_own=False
    # reads the own chunk there instead of copying it)
    phase1 = _reduce_scatter_stages(
        reduced, rows, pgs[0], op=op, hop=0, lost=lost, keep_own=False, **common
    )
    return _split_stages(flat, pieces, reduced, phase1, pgs[1], n, common, lost, owner)


def _split_stages(flat, pieces, reduced, phase1, pg, n, common, lost, owner) -> C.Stages:
    for works, _ in phase1:
        yield works, False
    gathered = torch.empty(n * reduced.numel(), dtype=torch.float32, device=flat.device)
    yield from _all_gather_stages(gathered, reduced, pg, hop=1, **common)
    torch._foreach_copy_(*pieces.views(flat, gathered))
    if lost is not None:
        _owner_loss(lost, gathered, reduced, owner, flat.dtype)
        torch._foreach_copy_(*pieces.views(owner.feedback, lost))


def _phases(tensor, pgs, n, op, spec, seed, step, bucket, backend, stats, owner) -> C.Stages:
    """Both phases over ``tensor`` (padded inside to whole chunks; ``pgs``: phase 1's group and
    phase 2's); the first's encodes run before this returns."""
    numel = tensor.numel()
    m = -(-numel // n)
    flat = tensor.view(-1)
    padded = flat
    if n * m != numel:
        # Pad inside so any length works; the tail is dropped after the gather.
        padded = torch.zeros(n * m, dtype=tensor.dtype, device=tensor.device)
        padded[:numel] = flat
    common = _stage_args(spec, seed, step, bucket, backend, stats)
    reduced = torch.empty(m, dtype=torch.float32, device=tensor.device)
    lost = None
    if owner.feedback is not None:
        lost = owner.feedback
        if padded is not flat:
            lost = torch.empty(n * m, dtype=torch.float32, device=tensor.device)
    # Encodes the reduce-scatter's chunks now; `padded` is free to be overwritten afterwards.
    phase1 = _reduce_scatter_stages(reduced, padded, pgs[0], op=op, hop=0, lost=lost, **common)
    return _stages(flat, padded, reduced, phase1, pgs[1], common, lost, owner)


def _stages(flat, padded, reduced, phase1, pg, common, lost, owner) -> C.Stages:
    for works, _ in phase1:
        yield works, False
    yield from _all_gather_stages(padded, reduced, pg, hop=1, **common)
    if lost is not None:
        _owner_loss(lost, padded, reduced, owner, padded.dtype)
        if lost is not owner.feedback:
            owner.feedback.copy_(lost[: flat.numel()])
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])


def _owner_loss(lost, gathered, reduced, owner, dtype) -> None:
    """Add the owner's phase-2 loss (its reduced chunk minus what every rank decoded of it,
    rounded to the result's ``dtype``) to its own chunk of ``lost``, which phase 1 left at 0."""
    m = reduced.numel()
    own = slice(owner.rank * m, (owner.rank + 1) * m)
    lost[own] += (reduced - gathered.view(-1)[own].to(dtype).float()) * owner.scale
