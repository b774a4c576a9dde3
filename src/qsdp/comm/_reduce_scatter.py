"""Single-level quantized reduce-scatter (QSDP, CGX) through one byte ``all_to_all_single``.

Rank ``r`` splits its input into ``n`` destination chunks of ``m`` elements, encodes the
``n - 1`` chunks bound for its peers straight into the send buffer, and one all-to-all (the split
towards itself is empty) moves them. The receiver decodes the ``n - 1`` payloads it got, sums them
in float32 onto its own chunk, which never left the rank and stays exact, and divides for AVG.
The layout is that of ``dist.reduce_scatter_tensor``: rank ``r`` receives chunk ``r``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..quant import (
    Backend,
    QuantSpec,
    decode_rows,
    decode_sum_finish,
    encode_rows,
    flagged_groups,
    sum_rows_finish,
)
from . import _common as C
from ._calls import checked
from ._graphs import CodecGraphs, ReplayedSite, check_replayable
from ._split import Split, check_split, fused_parts, fused_row
from ._stats import CommStats

__all__ = ["reduce_scatter", "reduce_scatter_wire_bytes"]

_NAME = "reduce_scatter"


def reduce_scatter_wire_bytes(
    numel: int,
    world_size: int,
    spec: QuantSpec,
    *,
    split: Split | None = None,
    element_size: int = 4,
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`reduce_scatter`.

    Args:
        numel: elements of the input (``world_size * m``).
        world_size: ranks in the group.
        spec: the quantizer.
        split: as passed to :func:`reduce_scatter` (raw elements travel beside the codes).
        element_size: bytes of one input element (the raw part's width).

    Returns:
        ``(world_size - 1) * spec.payload_bytes(m)``, with a split ``(world_size - 1)`` rows of
        :func:`~qsdp.comm.fused_row` (the uncompressed reduce-scatter hands over the ``n - 1``
        peers' chunks, ``(numel - m) * element_size``).
    """
    if split is None:
        return (world_size - 1) * spec.payload_bytes(numel // world_size)
    return (world_size - 1) * fused_row(spec, split.n_comp, split.n_raw * element_size)[1]


@checked("reduce_scatter")
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
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
    graphs: CodecGraphs | None = None,
) -> C.CommWork | None:
    """Quantized ``dist.reduce_scatter_tensor``: rank ``r`` gets the sum (or mean) of chunk ``r``.

    Error bound (per element, against the exact float64 reduction): with ``step_j`` the
    quantization step of the element's group in the chunk rank ``j`` sent, nearest rounding gives
    ``|out - exact| <= sum_{j != r} step_j / 2``, stochastic ``< sum_{j != r} step_j`` and
    unbiased; divide the bound by ``n`` for ``op="avg"``. Add float32 summation and the rounding
    to ``output``'s dtype. With Hadamard the per-rank bound holds in the rotated domain (per
    block, in L2). The own chunk adds no error.

    Args:
        output: tensor of ``m`` elements (float32/bf16/fp16, contiguous), ``m = input.numel() /
            world_size``.
        input: ``world_size * m`` elements, chunk ``j`` = ``input.view(-1)[j * m:(j + 1) * m]``
            is bound for rank ``j``. Encoded (and the own chunk copied) before the call returns.
        group: the process group (default: the world).
        spec: the quantizer, the same on every rank.
        split: which runs of each chunk travel raw (summed exactly in float32) beside the codes,
            in the same all-to-all (see [Note: policies inside flat buffers]); ``split.chunk``
            must equal ``m``.
        op: ``"avg"`` (default) or ``"sum"``, or ``dist.ReduceOp.AVG`` / ``SUM``.
        async_op: return a :class:`CommWork` whose ``wait()`` finishes the exchange and decodes.
        seed, step: key of the stochastic-rounding noise, the same on every rank; each rank and
            destination chunk gets its own noise stream (from the global rank and ``bucket``).
        bucket: separates buffers reduced in the same step.
        backend: the quantizer backend (``"auto"``: Triton on CUDA, reference on CPU).
        stats: the byte counter to record into (default :data:`qsdp.comm.comm_stats`).
        graphs: replay the encode and the decode from CUDA graphs captured in it at the first
            call of each shape and noise key, the same bits ([Note: codec segments replayed]
            in ``qsdp.comm._graphs``): CUDA tensors, a synchronous call (no ``async_op``), a
            ``spec`` with ``nonfinite="propagate"`` (the caller checks NaN/Inf) and the Triton
            backend.

    Returns:
        A :class:`CommWork` when ``async_op``, else None.
    """
    if graphs is not None:  # [Note: codec segments replayed]: the site made at its first call
        check_replayable(_NAME, async_op=async_op, spec=spec, backend=backend)
        site = replayed_site(
            graphs,
            output,
            input,
            group,
            spec=spec,
            split=split,
            op=op,
            seed=seed,
            bucket=bucket,
            backend=backend,
        )
        C.check_key(seed, step, bucket)
        site.run(output, input, step, C.resolve_stats(stats), _NAME)
        return None
    stages = _reduce_scatter_stages(
        output,
        input,
        group,
        spec=spec,
        split=split,
        op=op,
        seed=seed,
        step=step,
        bucket=bucket,
        hop=0,
        backend=backend,
        stats=C.resolve_stats(stats),
        name=_NAME,
        keep_own=async_op,
    )
    return C.run_stages(stages, async_op, result=output)


class _Buffers(NamedTuple):
    """What the captured segments of one reduce-scatter shape read and write
    ([Note: codec segments replayed] in ``_graphs.py``)."""

    rows: torch.Tensor | None  # [n, m], the input's dtype: each call's input copied in
    comp: torch.Tensor | None  # [n, n_comp], [n, n_raw]: a split's parts (several runs each),
    raw: torch.Tensor | None  # taken from each call's input (then no rows: one copy, not two)
    send: torch.Tensor  # [n - 1, row] uint8
    recv: torch.Tensor
    out: torch.Tensor  # [m], the output's dtype: copied out to each call's output
    step: torch.Tensor  # one int64: the noise's step, read by the encode kernel
    parts: tuple[int, ...] | None  # a split's [codes | raw] row, cut

    @classmethod
    def make(cls, input, output, n, m, spec, split) -> _Buffers:
        device = input.device
        rows = comp = raw = parts = None
        if split is None or split.one_run_each:  # (a split's parts: views of the rows)
            rows = torch.empty(n, m, dtype=input.dtype, device=device)
        if split is None:
            row = spec.payload_bytes(m)
        else:
            _, row, parts = fused_parts(spec, split.n_comp, split.n_raw * input.element_size())
            if not split.one_run_each:
                comp = torch.empty(n, split.n_comp, dtype=input.dtype, device=device)
                raw = comp.new_empty(n, split.n_raw)
        send = torch.empty(max(n - 1, 0), row, dtype=torch.uint8, device=device)
        return cls(
            rows=rows,
            comp=comp,
            raw=raw,
            send=send,
            recv=torch.empty_like(send),
            out=torch.empty(m, dtype=output.dtype, device=device),
            step=torch.zeros(1, dtype=torch.int64, device=device),
            parts=parts,
        )

    def split_parts(self, split: Split) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured input's compressed and raw parts: views of the rows (one run each), or
        the parts' buffers (filled by the call's :meth:`_Site.take`)."""
        if self.comp is None:
            return split.views(self.rows)
        return self.comp, self.raw


def replayed_site(
    graphs: CodecGraphs,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    spec: QuantSpec,
    split: Split | None,
    op: str | dist.ReduceOp,
    seed: int,
    bucket: int,
    backend: Backend,
    hop: int = 0,
    name: str = _NAME,
) -> _Site:
    """The replayed reduce-scatter's site of this call (made at its first call): ``hop`` and
    ``name`` as a composite call's phase runs it (CGX's phase 1: its noise and byte counter)."""
    return graphs.site(
        _NAME,
        group=group,
        input=input,
        output=output,
        layout=(spec, split, op, name),
        noise=(seed, bucket, hop),
        make=lambda key: _Site(
            graphs, output, input, group, key, spec, split, op, seed, bucket, backend, hop, name
        ),
    )


class _Site(ReplayedSite):
    """One call site of a replayed reduce-scatter (a group's hook at one width): its buffers
    (shared by the sites of its shape), its exchange's splits and its two segments."""

    def __init__(
        self, graphs, output, input, group, key, spec, split, op, seed, bucket, backend, hop, name
    ):
        op = C.parse_op(op)
        pg, n, r = C.group_info(group)
        m = check_chunks(output, input, n, "reduce_scatter")
        if split is not None:
            check_split(split, m, "each chunk")
        b = graphs.buffers(key, lambda: _Buffers.make(input, output, n, m, spec, split))
        super().__init__(graphs, key, (seed, bucket, hop), inp=b.rows, out=b.out, step=b.step)
        self.b, self.pg, self.r, self.n, self.name = b, pg, r, n, name
        self.spec, self.split, self.seed, self.backend = spec, split, seed, backend
        self.splits = [0 if j == r else b.send.shape[1] for j in range(n)]
        self._recv_flat, self._send_flat = b.recv.view(-1), b.send.view(-1)  # (made once)
        self.streams = C.peer_streams(r, n, bucket=bucket, hop=hop)
        self.divisor = n if op == "avg" else None

    def take(self, input: torch.Tensor) -> None:
        b = self.b
        if b.rows is None:  # a split's parts straight from the input (no rows buffer)
            self.split.take(input.view(self.n, -1), comp_out=b.comp, raw_out=b.raw)
        else:
            super().take(input)

    def encode(self) -> None:
        b, r, spec, kw = self.b, self.r, self.spec, {"seed": self.seed, "backend": self.backend}
        if self.split is None:
            _encode_chunks(b.rows, b.send, r, spec, self.streams, step=b.step, **kw)
            return
        comp, raw = b.split_parts(self.split)
        _encode_fused(comp, raw, b.send, b.parts, r, spec, self.streams, step=b.step, **kw)

    def exchange(self, stats: CommStats) -> None:
        if self.n > 1:  # on the current stream, after the encode ([Note: which stream ...])
            C.all_to_all(
                self._recv_flat,
                self._send_flat,
                self.splits,
                self.splits,
                self.pg,
                stats,
                self.name,
                stream="current",
            )

    def decode(self) -> None:
        b, r = self.b, self.r
        if self.split is None:
            m = b.out.numel()
            _decode_chunks(b.recv, b.rows[r], b.out, m, self.spec, self.divisor, self.backend)
            return
        comp, raw = b.split_parts(self.split)
        _decode_fused(
            b.recv,
            b.parts,
            comp[r],
            raw[r],
            b.out,
            self.split,
            self.spec,
            self.divisor,
            self.backend,
        )


def check_chunks(output: torch.Tensor, input: torch.Tensor, n: int, what: str) -> int:
    """Validate a reduce-scatter's shapes; returns the chunk length ``m``."""
    C.check_float(input, "input")
    C.check_float(output, "output")
    C.check_contiguous(output, "output")
    C.check_same_device(output, input, "output and input")
    numel = input.numel()
    if numel % n:
        raise ValueError(
            f"{what}: input has {numel} elements, not divisible by the {n} destination ranks; "
            f"pad it to {-(-numel // n) * n} elements (the layout of dist.reduce_scatter_tensor)"
        )
    m = numel // n
    if output.numel() != m:
        raise ValueError(
            f"{what}: output has {output.numel()} elements; expected {numel} / {n} = {m}"
        )
    return m


def _reduce_scatter_stages(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    spec: QuantSpec,
    op: str | dist.ReduceOp,
    seed: int,
    step: int,
    bucket: int,
    hop: int,
    backend: Backend,
    stats: CommStats,
    name: str,
    split: Split | None = None,
    count_call: bool = True,
    lost: torch.Tensor | None = None,
    keep_own: bool = True,
) -> C.Stages:
    """Validate and encode now; return the stage generator. ``keep_own``: copy the own chunk
    now (the caller may write ``input`` before the last stage runs); else the decode reads it
    from ``input`` (a call that runs every stage before it returns). ``lost`` (float32,
    ``input``'s size): filled with what this rank's encodes lose of ``input``, chunk ``j`` minus
    the decode of the payload sent to ``j`` (its own chunk and raw elements travel exact: 0),
    for error feedback."""
    C.check_spec(spec)
    op = C.parse_op(op)
    C.check_key(seed, step, bucket)
    pg, n, r = C.group_info(group)
    m = check_chunks(output, input, n, "reduce_scatter")
    if split is not None:
        check_split(split, m, "each chunk")
    if count_call:
        stats.count_call(name)
    if split is not None:
        call = _Call(pg, n, r, m, spec, op, seed, step, bucket, hop, backend, stats, name)
        return _fused_stages(output, input, split, call, lost=lost, keep_own=keep_own)
    chunks = input.reshape(n, m)
    own = chunks[r].clone() if keep_own else chunks[r]
    nbytes = spec.payload_bytes(m)
    send = torch.empty((n - 1) * nbytes, dtype=torch.uint8, device=input.device)
    peers = [j for j in range(n) if j != r]
    enc_spec = spec.propagating()
    # the noise identity: the place in the group ([Note: noise per place in the group])
    streams = C.peer_streams(r, n, bucket=bucket, hop=hop)
    _encode_chunks(chunks, send, r, enc_spec, streams, seed=seed, step=step, backend=backend)
    if lost is not None:
        rows = lost.view(n, m)
        rows.copy_(chunks)
        rows[r].zero_()
        if peers and m:
            _lose(rows, r, send.view(n - 1, nbytes), m, spec, backend)
    if enc_spec is not spec:  # every rank agrees before anything is exchanged
        bad = flagged_groups(send.view(n - 1, nbytes), m, spec) + (~torch.isfinite(own)).sum()
        C.agree_finite(bad, [pg], stats, name)
    return _exchange_decode(output, own, send, pg, n, r, m, spec, op, backend, stats, name)


def _exchange_decode(output, own, send, pg, n, r, m, spec, op, backend, stats, name) -> C.Stages:
    nbytes = spec.payload_bytes(m)
    recv = send.view(n - 1, nbytes)  # (no peers, or nothing to send: no rows to decode)
    if n > 1 and m > 0:
        recv = torch.empty_like(send)
        splits = [0 if j == r else nbytes for j in range(n)]
        yield [C.all_to_all(recv, send, splits, splits, pg, stats, name)], True
        recv = recv.view(n - 1, nbytes)
    _decode_chunks(recv, own, output, m, spec, n if op == "avg" else None, backend)


def _encode_chunks(chunks, send, r, spec, streams, *, seed, step, backend) -> None:
    """The ``n - 1`` peers' chunks of ``chunks`` (``[n, m]``) into ``send``, one launch."""
    n, m = chunks.shape
    nbytes = spec.payload_bytes(m)
    encode_rows(
        chunks,
        spec,
        out=send.view(n - 1, nbytes),
        streams=streams,
        skip=r,
        seed=seed,
        step=step,
        backend=backend,
    )


def _decode_chunks(recv, own, output, m, spec, divisor, backend) -> None:
    """Own chunk + the decoded peers' payloads (``recv``), divided, into ``output``: one
    launch ([Note: the receive side in one launch])."""
    decode_sum_finish(
        recv,  # ([n - 1, payload bytes])
        m,
        spec,
        base=own,
        out=output.view(-1),
        divisor=divisor,
        backend=backend,
    )


def _lose(rows, r, payloads, numel, spec, backend) -> None:
    """``rows[j] -= decode(payloads)`` for every row ``j != r`` (in order), rows holding what was
    encoded: what the encodes lost (float32). Two slices, not ``rows[peers]``: indexing a CUDA
    tensor by a Python list copies the index from pageable memory, a host sync per call."""
    decoded = decode_rows(payloads, numel, spec, backend=backend)
    rows[:r] -= decoded[:r]
    rows[r + 1 :] -= decoded[r:]


class _Call(NamedTuple):
    """One reduce-scatter call's group, quantizer and noise key, for its split stages."""

    pg: dist.ProcessGroup | None
    n: int
    r: int
    m: int
    spec: QuantSpec
    op: str
    seed: int
    step: int
    bucket: int
    hop: int
    backend: Backend
    stats: CommStats
    name: str


def _fused_stages(output, input, split, call: _Call, *, lost=None, keep_own=True) -> C.Stages:
    """A policy split's reduce-scatter: ``[codes | raw]`` rows in one all-to-all; the
    receiver decodes the codes onto its own chunk's (exact) and sums the raw values in float32,
    each part divided and written to its runs of ``output``."""
    pg, n, r, m, spec, op, seed, step, bucket, hop, backend, stats, name = call
    comp, raw = split.views(input.view(n, m))  # only read
    own_comp, own_raw = comp[r], raw[r]
    if keep_own and split.one_run_each:  # (views of input; take() made copies)
        own_comp, own_raw = own_comp.clone(), own_raw.clone()
    raw_bytes = split.n_raw * raw.element_size()
    nbytes, row, parts = fused_parts(spec, split.n_comp, raw_bytes)
    # (the parts' padding is never read: no zeroing)
    send = torch.empty(n - 1, row, dtype=torch.uint8, device=input.device)
    enc_spec = spec.propagating()
    streams = C.peer_streams(r, n, bucket=bucket, hop=hop)
    codes, _ = _encode_fused(
        comp, raw, send, parts, r, enc_spec, streams, seed=seed, step=step, backend=backend
    )
    if lost is not None:  # the codes' losses; the own row and the raw elements travel exact
        err = comp.to(torch.float32, copy=True)
        err[r].zero_()
        if n > 1 and split.n_comp:
            _lose(err, r, codes, split.n_comp, spec, backend)
        split.put(lost.view(n, m), err, torch.zeros(n, split.n_raw, device=input.device))
    if enc_spec is not spec:  # every rank agrees before anything is exchanged
        bad = flagged_groups(codes, split.n_comp, spec) + (~torch.isfinite(raw)).sum()
        bad = bad + (~torch.isfinite(own_comp)).sum()
        C.agree_finite(bad, [pg], stats, name)
    recv = send  # (no peers: no rows)
    if n > 1 and m > 0:
        recv = torch.empty_like(send)
        splits = [0 if j == r else row for j in range(n)]
        yield [C.all_to_all(recv.view(-1), send.view(-1), splits, splits, pg, stats, name)], True
    divisor = n if op == "avg" else None
    _decode_fused(recv, parts, own_comp, own_raw, output, split, spec, divisor, backend)


def _encode_fused(comp, raw, send, parts, r, spec, streams, *, seed, step, backend):
    """The peers' ``[codes | raw]`` rows of ``comp`` and ``raw`` (``[n, ...]``) into ``send``
    (``[n - 1, row]`` uint8, cut by ``parts``); returns ``send``'s codes and raw parts."""
    n = comp.shape[0]
    # each row's parts as views, cut once per call ([Note: a split's plan] in _split.py)
    codes, _, raw_slots, _ = send.split_with_sizes(parts, dim=1)
    if comp.shape[1]:  # the n - 1 peers' codes, one launch; noise per place in the group
        encode_rows(
            comp,
            spec,
            out=codes,
            streams=streams,
            skip=r,
            seed=seed,
            step=step,
            backend=backend,
        )
    raw_rows = raw.view(torch.uint8)  # the peers' rows: those before r, then those after
    if r > 0:
        raw_slots[:r].copy_(raw_rows[:r])
    if r < n - 1:
        raw_slots[r:].copy_(raw_rows[r + 1 :])
    return codes, raw_slots


def _decode_fused(recv, parts, own_comp, own_raw, output, split, spec, divisor, backend) -> None:
    """The peers' ``[codes | raw]`` rows (``recv``) summed onto the own chunk's parts, divided,
    into their runs of ``output``."""
    got_codes, _, got_raw, _ = recv.split_with_sizes(parts, dim=1)
    # [Note: the receive side in one launch]
    # The compressed part goes from the payloads to the output in one kernel (decode, the sum
    # onto the own chunk, the division, the cast), then to its runs in one copy when there are
    # several, where it took a float32 copy of the own chunk, a decode, a division into a
    # temporary and the copy: two launches and ~8 torch ops fewer per call (issue 32). The
    # copy to the runs stays outside the kernel: a scatter inside it (a search of the runs per
    # tile) made the decode 4-7x slower on 2x H200, its stores no longer vectorized.
    # The raw part (each peer's raw values summed onto the own chunk's in float32, divided)
    # goes to its runs in one launch (``sum_rows_finish``), where it took a float32 copy, an
    # add per peer, a division into a temporary and a copy: ~8 torch ops fewer per call.
    decode_sum_finish(
        got_codes,
        split.n_comp,
        spec,
        base=own_comp,
        out=output.view(-1),
        divisor=divisor,
        runs=split.places(compressed=True),
        backend=backend,
    )
    if split.n_raw:
        sum_rows_finish(
            got_raw.view(own_raw.dtype),  # (each row's part starts on a 16-byte boundary: a view)
            base=own_raw,
            out=output.view(-1),
            places=split.places(compressed=False),
            divisor=divisor,
            backend=backend,
        )
