"""The kernel steps of SDP4Bit's two-level reduce-scatter on given buffers, and its replayed site.

:func:`~qsdp.comm.hierarchical_reduce_scatter` runs three steps around its two exchanges
([Note: two hops, one flat layout] in ``_hierarchical``): the intra-node encodes
(:func:`encode_intra`), the middle hop (:func:`recode`: the own node's payloads summed onto the
own chunk, every other node's re-encoded for the inter-node hop) and the inter-node decode
(:func:`decode_inter`). The eager call allocates each piece's buffers and runs them; with
``graphs=`` the same steps run on one set of buffers per shape, captured in CUDA graphs
(:class:`TwoLevelSite`).

[Note: one launch per run of rows]
A column of the mesh (the chunks of every node bound for one local peer) is a set of input rows;
for a row-major mesh over the flat group they are evenly spaced (``a' * B + b'``), one strided
``[A, m]`` view, so its encodes are one ``encode_rows`` launch (the own column: two at most,
around the own chunk), where an encode per chunk cost ``A * B - 1`` launches a piece. Rows that
are not evenly spaced (a mesh listing its ranks in another order) are cut into runs that are
(``MeshLayout.columns``), a launch each. The bytes are those of an encode per chunk
(``encode_rows`` writes exactly what ``encode`` would, row by row: tested).

[Note: two levels replayed]
With ``graphs=`` (``Schedule(graphs=True)``, pipeline 1) a call copies its input into the
captured rows (with a policy split: its two parts, taken from the input straight into their
captured buffers, one copy where rows and parts took two), writes its step into the captured
step word and replays three segments with the exchanges eager between them ([Note: codec
segments replayed] in ``_graphs``): the encode (the own chunk into the float32 sum, the
intra-node encodes), the intra-node all-to-all, the middle hop (whose re-encodes draw noise:
captured per site, like the encode; staleness 1's node average written there too), the
inter-node all-to-all and a split's raw part's plain reduce-scatter, and the decode (the other
nodes' partial sums onto the own one, the division and cast, a split's raw part divided and
every part put in place). Both exchanges run on the current stream, where the eager call
issues each on its group's stream (its pieces overlap there): one piece has nothing to overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..quant import Backend, QuantSpec, decode_sum, decode_sum_encode, encode_rows
from . import _common as C
from ._graphs import CodecGraphs, ReplayedSite
from ._mesh_layout import MeshLayout, Run
from ._reduce_scatter import check_chunks
from ._split import Split, check_split
from ._stats import CommStats

__all__ = ["TwoLevelSite", "decode_inter", "encode_intra", "recode"]


def encode_intra(
    chunks: torch.Tensor,
    piece: tuple[int, int],
    *,
    layout: MeshLayout,
    stack: torch.Tensor,
    send: torch.Tensor,
    spec: QuantSpec,
    stream_of: Callable[[int], int],
    seed: int,
    step: int | torch.Tensor,
    backend: Backend,
) -> None:
    """Piece ``(o, n)`` of every chunk of ``chunks`` (``[N, m]``) encoded for the local peers:
    the peers' columns into ``send`` (``[B - 1, A, bytes]``, intra group rank order), the own
    column but the own chunk (added unquantized) into ``stack[B - 1]`` (``[B, A, bytes]``; row
    ``a`` unwritten); the chunk in input row ``c`` with noise stream ``stream_of(c)``
    ([Note: one launch per run of rows])."""
    o, n = piece
    a, me = layout.coord[0], layout.me_intra
    for j, runs in enumerate(layout.columns):
        dest = stack[-1] if j == me else send[j - (j > me)]
        for run in runs:
            parts = (run,)
            if j == me and run.node <= a < run.node + run.count:  # around the own chunk
                parts = (run._replace(count=a - run.node), _after(run, a - run.node + 1))
            for node, count, first, stride in parts:
                if count:
                    encode_rows(
                        chunks[first : first + stride * (count - 1) + 1 : stride, o : o + n],
                        spec,
                        out=dest[node : node + count],
                        streams=[stream_of(first + stride * i) for i in range(count)],
                        seed=seed,
                        step=step,
                        backend=backend,
                    )


def _after(run: Run, k: int) -> Run:
    """The rows of ``run`` from its ``k``-th on."""
    return Run(run.node + k, run.count - k, run.first + run.stride * k, run.stride)


def recode(
    stack: torch.Tensor,
    acc: torch.Tensor,
    send: torch.Tensor,
    n: int,
    *,
    layout: MeshLayout,
    intra_spec: QuantSpec,
    inter_spec: QuantSpec,
    stream_of: Callable[[int], int],
    seed: int,
    step: int | torch.Tensor,
    backend: Backend,
) -> None:
    """The middle hop of a piece of ``n`` elements: the local peers' payloads of the own chunk
    (``stack[:B - 1, a]``) summed onto ``acc`` (float32); each other node's ``B`` payloads of
    this rank's local index summed and re-encoded at the inter-node width into its slot of
    ``send`` (``[A - 1, bytes]``, inter group rank order), noise ``stream_of(input row)``."""
    a = layout.coord[0]
    decode_sum(stack[:-1, a], n, intra_spec, out=acc, accumulate=True, backend=backend)
    for slot, (node, row) in enumerate(layout.others):
        decode_sum_encode(
            stack[:, node],
            n,
            intra_spec,
            inter_spec,
            seed=seed,
            step=step,
            stream=stream_of(row),
            out=send[slot],
            backend=backend,
        )


def decode_inter(
    recv: torch.Tensor, acc: torch.Tensor, n: int, *, spec: QuantSpec, backend: Backend
) -> None:
    """The other nodes' partial sums (``recv``, ``[A - 1, bytes]``) decoded onto ``acc``."""
    decode_sum(recv.view(recv.shape[0], -1), n, spec, out=acc, accumulate=True, backend=backend)


class _Buffers(NamedTuple):
    """What the captured segments of one two-level shape read and write ([Note: two levels
    replayed])."""

    rows: torch.Tensor | None  # [N, m], the input's dtype: each call's input copied in
    comp: torch.Tensor | None  # [N, n_comp], [N, n_raw]: a split's parts, taken from each
    raw: torch.Tensor | None  # call's input (then no rows: one copy, not two)
    stack: torch.Tensor  # [B, A, intra bytes]: the local peers' payloads, the own encodes
    send: torch.Tensor  # [B - 1, A, intra bytes]
    acc: torch.Tensor  # [n_comp] float32: the own chunk's sum
    send2: torch.Tensor  # [A - 1, inter bytes]
    recv2: torch.Tensor
    comp_out: torch.Tensor | None  # a split's parts of the result
    raw_out: torch.Tensor | None
    out: torch.Tensor  # [m], the output's dtype: copied out to each call's output
    step: torch.Tensor  # one int64: the noise's step, read by the encodes
    avg: torch.Tensor  # [m] float32: the own chunk's node average (node_average=)
    avg_comp: torch.Tensor  # [n_comp] float32: its compressed part (avg itself without a split)

    @classmethod
    def make(cls, input, output, shape, m, intra, inter, split) -> _Buffers:
        (na, nb), device, u8 = shape, input.device, torch.uint8
        rows = comp = raw = comp_out = raw_out = None
        n = m
        if split is None:
            rows = torch.empty(na * nb, m, dtype=input.dtype, device=device)
        else:
            n = split.n_comp
            comp = torch.empty(na * nb, n, dtype=input.dtype, device=device)
            raw = comp.new_empty(na * nb, split.n_raw)
            comp_out = torch.empty(n, dtype=output.dtype, device=device)
            raw_out = raw.new_empty(split.n_raw)
        b8, b4 = intra.payload_bytes(n), inter.payload_bytes(n)
        send2 = torch.empty(na - 1, b4, dtype=u8, device=device)
        avg = torch.empty(m, dtype=torch.float32, device=device)
        return cls(
            rows=rows,
            comp=comp,
            raw=raw,
            stack=torch.empty(nb, na, b8, dtype=u8, device=device),
            send=torch.empty(nb - 1, na, b8, dtype=u8, device=device),
            acc=torch.empty(n, dtype=torch.float32, device=device),
            send2=send2,
            recv2=torch.empty_like(send2),
            comp_out=comp_out,
            raw_out=raw_out,
            out=torch.empty(m, dtype=output.dtype, device=device),
            step=torch.zeros(1, dtype=torch.int64, device=device),
            avg=avg,
            avg_comp=avg if split is None else avg.new_empty(n),
        )


class TwoLevelSite(ReplayedSite):
    """One call site of a replayed two-level reduce-scatter (a group's hook): its buffers
    (shared by the sites of its shape), its exchanges' splits and its three segments
    ([Note: two levels replayed]).

    ``average``: the middle hop also writes the own chunk's node average (the eager call's
    ``node_average`` argument), which the call's :attr:`report` is handed before the inter-node
    exchange."""

    report: Callable[[torch.Tensor], object] | None = None
    """The current call's ``node_average`` (set by the caller around :meth:`run`)."""

    def __init__(
        self,
        graphs: CodecGraphs,
        key: tuple,
        noise: tuple,
        *,
        output: torch.Tensor,
        input: torch.Tensor,
        layout: MeshLayout,
        shape: tuple[int, int],
        group: dist.ProcessGroup | None,
        intra_spec: QuantSpec,
        inter_spec: QuantSpec,
        split: Split | None,
        op: str,
        seed: int,
        bucket: int,
        backend: Backend,
        name: str,
        average: bool = False,
    ) -> None:
        (na, nb), op = shape, C.parse_op(op)
        m = check_chunks(output, input, na * nb, name)
        if split is not None:
            check_split(split, m, "each chunk")
        b = graphs.buffers(
            key, lambda: _Buffers.make(input, output, shape, m, intra_spec, inter_spec, split)
        )
        super().__init__(graphs, key, noise, inp=b.rows, out=b.out, step=b.step)
        self.hops = (((key, noise, "recode"), self.recode, self.exchange_inter),)
        self.b, self.layout, self.shape, self.group, self.split = b, layout, shape, group, split
        self.intra_spec, self.inter_spec, self.op = intra_spec, inter_spec, op
        self.seed, self.backend, self.name, self.average = seed, backend, name, average
        self.n = b.acc.numel()
        self.own = layout.chunk_of(*layout.coord)
        me = layout.coord[0] * nb + layout.coord[1]  # [Note: noise per place in the group]
        self._noise = [
            lambda c, hop=hop: C.noise_stream(me, c, bucket=bucket, hop=hop) for hop in (0, 1)
        ]
        row8, row4 = b.send.shape[1] * b.send.shape[2], b.send2.shape[1]
        self.splits = (
            [0 if j == layout.me_intra else row8 for j in range(nb)],
            [0 if j == layout.me_inter else row4 for j in range(na)],
        )
        self._flat = (b.stack[:-1].view(-1), b.send.view(-1), b.recv2.view(-1), b.send2.view(-1))

    def take(self, input: torch.Tensor) -> None:
        if self.split is None:
            super().take(input)
        else:  # the parts straight from the input (no rows buffer)
            b = self.b
            self.split.take(input.view(b.comp.shape[0], -1), comp_out=b.comp, raw_out=b.raw)

    def encode(self) -> None:
        b = self.b
        chunks = b.rows if self.split is None else b.comp
        b.acc.copy_(chunks[self.own])
        encode_intra(
            chunks,
            (0, self.n),
            layout=self.layout,
            stack=b.stack,
            send=b.send,
            spec=self.intra_spec,
            stream_of=self._noise[0],
            seed=self.seed,
            step=b.step,
            backend=self.backend,
        )

    def exchange(self, stats: CommStats) -> None:
        if self.n:  # on the current stream, after the encode ([Note: which stream ...])
            recv, send = self._flat[:2]
            splits = self.splits[0]
            C.all_to_all(
                recv, send, splits, splits, self.layout.intra, stats, self.name, stream="current"
            )

    def recode(self) -> None:
        recode(
            self.b.stack,
            self.b.acc,
            self.b.send2,
            self.n,
            layout=self.layout,
            intra_spec=self.intra_spec,
            inter_spec=self.inter_spec,
            stream_of=self._noise[1],
            seed=self.seed,
            step=self.b.step,
            backend=self.backend,
        )
        if self.average:  # the own chunk over the node (the eager call's node_average)
            b = self.b
            torch.div(b.acc, self.shape[1], out=b.avg_comp)
            if self.split is not None:  # (the raw part: this rank's own values)
                own_raw = b.raw[self.own].to(torch.float32).view(1, -1)
                self.split.put(b.avg.view(1, -1), b.avg_comp.view(1, -1), own_raw)

    def exchange_inter(self, stats: CommStats) -> None:
        b = self.b
        if self.report is not None:  # (in stream order: before the exchange)
            self.report(b.avg)
        if self.n:
            recv, send = self._flat[2:]
            splits = self.splits[1]
            C.all_to_all(
                recv, send, splits, splits, self.layout.inter, stats, self.name, stream="current"
            )
        if self.split is not None:  # the raw part: one plain SUM over the flat group
            raw = b.raw.view(-1)
            C.reduce_scatter_sum(b.raw_out, raw, self.group, stats, self.name, stream="current")

    def decode(self) -> None:
        b, (na, nb) = self.b, self.shape
        if self.n:
            decode_inter(b.recv2, b.acc, self.n, spec=self.inter_spec, backend=self.backend)
        if self.split is None:
            C.finish_into(b.out, b.acc, self.op, na * nb)
            return
        C.finish_into(b.comp_out, b.acc, self.op, na * nb)
        if self.op == "avg":
            b.raw_out.div_(na * nb)
        self.split.put(b.out.view(1, -1), b.comp_out.view(1, -1), b.raw_out.view(1, -1))
