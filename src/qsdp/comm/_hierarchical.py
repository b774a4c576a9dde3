"""SDP4Bit's two-level quantized reduce-scatter (TLq-HS) over an (inter, intra) device mesh.

[Note: two hops, one flat layout]
``N = A * B`` ranks on ``A`` nodes of ``B`` GPUs; rank ``(a, b)`` (mesh coordinate) must end with
chunk ``c = a * B + b`` of the input, reduced over all ``N`` ranks, exactly as a flat
reduce-scatter would leave it. Each input chunk holds ``m`` elements. Drawn for A = B = 2::

    input of rank (a, b):   | c0 | c1 | c2 | c3 |        c = a' * B + b'  is bound for (a', b')

    1. intra-node all-to-all, 8 bits, Hadamard domain. To local peer b'' go the chunks of every
       node's rank b'': {a' * B + b'' for all a'}, each encoded on its own (H then quantize).
         (a, b) --[c(0,b''), c(1,b'')]--> (a, b'')          send [B-1, A, payload8(m)]

    2. on (a, b): for each node a' the B payloads of chunk (a', b) (own encode included)
         a' != a:  decode + fp32 sum + re-encode at 4 bits, fused, still rotated
                   -> one partial sum of node a for chunk (a', b)
         a' == a:  decode + sum onto the own chunk, unquantized (it stays on this rank)

    3. inter-node all-to-all, 4 bits, among the ranks with local index b:
         (a, b) --[partial of node a for (a', b)]--> (a', b)  send [A-1, payload4(m)]

    4. decode the A-1 partials, sum onto step 2's result, inverse Hadamard (inside decode),
       divide by N for AVG -> chunk a * B + b.

With ``pipeline=P`` the ``m`` elements are cut into up to ``P`` pieces (whole quantizer groups)
and the hops overlap: the intra all-to-all of piece ``p + 1`` is in flight while piece ``p`` is
re-encoded and sent between nodes. On one node (``A == 1``) only the intra level runs, with one
GPU a node (``B == 1``) only the inter level: both are the single-level
:func:`~qsdp.comm.reduce_scatter` with that level's quantizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..quant import Backend, QuantSpec, flagged_groups
from . import _common as C
from ._graphs import CodecGraphs, check_replayable
from ._mesh_layout import MeshLayout, mesh_layout
from ._reduce_scatter import (
    _reduce_scatter_stages,
    check_chunks,
    reduce_scatter_wire_bytes,
    replayed_site,
)
from ._split import Split, check_split
from ._stats import CommStats
from ._two_level import TwoLevelSite, decode_inter, encode_intra, recode

__all__ = ["hierarchical_reduce_scatter", "hierarchical_reduce_scatter_wire_bytes"]

_NAME = "hierarchical_reduce_scatter"


def _check_specs(intra_spec: QuantSpec, inter_spec: QuantSpec) -> None:
    C.check_spec(intra_spec, "intra_spec")
    C.check_spec(inter_spec, "inter_spec")
    for field in ("group_size", "hadamard_block", "hadamard_seed"):
        if getattr(intra_spec, field) != getattr(inter_spec, field):
            raise ValueError(
                f"intra_spec.{field}={getattr(intra_spec, field)!r} and inter_spec.{field}="
                f"{getattr(inter_spec, field)!r} differ: the middle hop re-encodes in the "
                f"Hadamard domain group by group, so both levels need one {field}; e.g. "
                "QuantSpec(bits=8, ...) and QuantSpec(bits=4, ...) with group_size=128, "
                "hadamard_block=32"
            )


def _pieces(m: int, group_size: int, pipeline: int) -> list[tuple[int, int]]:
    """(offset, length) of up to ``pipeline`` pieces of ``m``, cut at group boundaries."""
    if m == 0:
        return []
    groups = -(-m // group_size)
    per = -(-groups // min(pipeline, groups)) * group_size
    return [(o, min(per, m - o)) for o in range(0, m, per)]


def hierarchical_reduce_scatter_wire_bytes(
    numel: int,
    inter_size: int,
    intra_size: int,
    intra_spec: QuantSpec,
    inter_spec: QuantSpec,
    *,
    pipeline: int = 1,
    split: Split | None = None,
    element_size: int = 4,
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`hierarchical_reduce_scatter`.

    Args:
        numel: elements of the input (``inter_size * intra_size * m``).
        inter_size, intra_size: the mesh's shape ``(A, B)``.
        intra_spec, inter_spec: the two levels' quantizers.
        pipeline: as passed to the collective.
        split, element_size: a policy split and the input's element size: its raw part
            travels in one plain reduce-scatter over the flat group.

    Returns:
        Per piece of ``L`` elements: ``(B-1) * A * intra_spec.payload_bytes(L)`` intra-node plus
        ``(A-1) * inter_spec.payload_bytes(L)`` inter-node; the single-level count when ``A`` or
        ``B`` is 1.
    """
    a, b = inter_size, intra_size
    if split is not None:
        if a == 1 or b == 1:
            spec = intra_spec if a == 1 else inter_spec
            return reduce_scatter_wire_bytes(
                numel, a * b, spec, split=split, element_size=element_size
            )
        comp = hierarchical_reduce_scatter_wire_bytes(
            a * b * split.n_comp, a, b, intra_spec, inter_spec, pipeline=pipeline
        )
        return comp + (a * b - 1) * split.n_raw * element_size
    if a == 1:
        return reduce_scatter_wire_bytes(numel, b, intra_spec)
    if b == 1:
        return reduce_scatter_wire_bytes(numel, a, inter_spec)
    m = numel // (a * b)
    return sum(
        (b - 1) * a * intra_spec.payload_bytes(n) + (a - 1) * inter_spec.payload_bytes(n)
        for _, n in _pieces(m, intra_spec.group_size, pipeline)
    )


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    mesh: DeviceMesh,
    intra_spec: QuantSpec,
    inter_spec: QuantSpec,
    op: str | dist.ReduceOp = "avg",
    pipeline: int = 1,
    group: dist.ProcessGroup | None = None,
    split: Split | None = None,
    async_op: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    backend: Backend = "auto",
    stats: CommStats | None = None,
    node_average: Callable[[torch.Tensor], object] | None = None,
    graphs: CodecGraphs | None = None,
) -> C.CommWork | None:
    """Two-level quantized reduce-scatter over ``mesh`` with the layout of a flat one.

    Error bound (per element, against the exact float64 reduction over all ``N = A * B``
    ranks): every other rank's contribution is quantized once by ``intra_spec`` and every other
    node's partial sum once more by ``inter_spec``; the own contribution and the own node's
    partial are never re-quantized. So ``|err| <= sum_{j != me} e_intra(j) + sum_{a' != a}
    e_inter(a')``, ``e = step / 2`` for nearest rounding and ``< step`` for stochastic rounding
    (unbiased), ``step`` being the quantization step of the element's group in that payload.
    With Hadamard the steps are those of the rotated data and the bound holds for the rotated
    error ``H (out - exact)``. Divide by ``N`` for AVG; add float32 summation and the rounding
    to ``output``'s dtype.

    Args:
        output: ``m`` elements (float32/bf16/fp16, contiguous).
        input: ``N * m`` elements in the layout of a flat reduce-scatter over ``group``: chunk
            ``j`` is bound for the group's rank ``j`` (without ``group``: for the ``j``-th
            smallest rank of the mesh, i.e. global rank ``j`` for a mesh over the world).
            Encoded, every pipeline piece, before the call returns.
        mesh: 2-D ``DeviceMesh``, dim 0 across nodes (inter), dim 1 within a node (intra), e.g.
            ``init_device_mesh("cuda", (nodes, gpus), mesh_dim_names=("inter", "intra"))``;
            its ranks may be listed in any order (see [Note: any rank order]).
        intra_spec: the intra-node quantizer (SDP4Bit: 8 bits, group 128, Hadamard 32).
        inter_spec: the inter-node quantizer (SDP4Bit: 4 bits); same ``group_size``,
            ``hadamard_block`` and ``hadamard_seed`` as ``intra_spec``.
        op: ``"avg"`` (default) or ``"sum"``, or ``dist.ReduceOp.AVG`` / ``SUM``.
        pipeline: cut each chunk into up to this many pieces (whole groups) so the two hops
            overlap; 1 sends each hop in one all-to-all.
        group: the flat group whose layout ``input`` and ``output`` follow (e.g. FSDP2's shard
            group); it must hold exactly the mesh's ranks. Default: the mesh's ranks in
            increasing order.
        split: which runs of each chunk travel raw (see [Note: policies inside flat buffers]):
            on one level inside the all-to-all, on two levels in one plain SUM reduce-scatter
            over ``group`` (which is then required unless the mesh covers the world).
        async_op: return a :class:`CommWork`; all pieces' intra-node hops finish before the call
            returns, the inter-node hops are in flight until ``wait()``.
        seed, step: key of the stochastic-rounding noise, the same on every rank; every rank,
            hop, chunk and piece draws its own stream (from the global rank and ``bucket``).
        bucket: separates buffers reduced in the same step.
        backend: the quantizer backend (``"auto"``: Triton on CUDA, reference on CPU).
        stats: the byte counter to record into (default :data:`qsdp.comm.comm_stats`).
        node_average: called once, as soon as the intra-node level is done (before the
            inter-node exchange starts), with an ``m``-element float32 tensor: this rank's
            chunk averaged over its node's ranks (their contributions as the intra-node codes
            carry them; the raw part of a ``split``, which has no node level, is this rank's own
            values). An estimate of the result from the node's batches, for staleness 1's weight
            prediction ([Note: weight prediction]); use it in stream order (on CUDA the stream
            current at the call). With one rank per node it is the own chunk; on one node, the
            result's average, after the exchange.
        graphs: replay the kernels between the exchanges from CUDA graphs captured in it at
            the first call of each shape and noise key, the same bits ([Note: two levels
            replayed] in ``qsdp.comm._two_level``): CUDA tensors, a synchronous call, specs
            with ``nonfinite="propagate"`` (the caller checks NaN/Inf), the Triton backend
            and ``pipeline=1``.

    Returns:
        A :class:`CommWork` when ``async_op``, else None.
    """
    _check_specs(intra_spec, inter_spec)
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
        raise ValueError(f"pipeline={pipeline!r} must be an int >= 1; try 2 or 4")
    layout = mesh_layout(mesh, group)
    na, nb = mesh.size(0), mesh.size(1)
    stats = C.resolve_stats(stats)
    common = dict(
        op=op,
        seed=seed,
        step=step,
        bucket=bucket,
        hop=0,
        backend=backend,
        stats=stats,
        name=_NAME,
        split=split,
    )
    if graphs is not None:
        return _replayed(
            output,
            input,
            layout=layout,
            shape=(na, nb),
            group=group,
            intra_spec=intra_spec,
            inter_spec=inter_spec,
            graphs=graphs,
            async_op=async_op,
            pipeline=pipeline,
            node_average=node_average,
            **common,
        )
    if na == 1 or nb == 1:  # one level: a flat reduce-scatter over the mesh's only group
        stages = _one_level(
            output,
            input,
            layout=layout,
            shape=(na, nb),
            specs=(intra_spec, inter_spec),
            node_average=node_average,
            op=op,
            stages_of=lambda x, sub, spec: _reduce_scatter_stages(
                output, x, sub, spec=spec, **common
            ),
        )
        return C.run_stages(stages, async_op, result=output)
    op = C.parse_op(op)
    C.check_key(seed, step, bucket)
    m = check_chunks(output, input, na * nb, "hierarchical_reduce_scatter")
    if split is not None:
        check_split(split, m, "each chunk")
        _check_raw_group(group, mesh.size())
    stats.count_call(_NAME)
    chunks, out = input.reshape(na * nb, m), output
    if split is not None:
        chunks, raw = split.take(chunks)
        out = torch.empty(split.n_comp, dtype=output.dtype, device=output.device)
        raw_out = torch.empty(split.n_raw, dtype=raw.dtype, device=raw.device)
        if node_average is not None:
            node_average = _with_own_raw(node_average, split, raw[layout.chunk_of(*layout.coord)])
    plan = _Plan(
        chunks=chunks,
        layout=layout,
        shape=(na, nb),
        intra_spec=intra_spec.propagating(),
        inter_spec=inter_spec.propagating(),
        check=intra_spec.nonfinite != intra_spec.propagating().nonfinite,
        pieces=_pieces(chunks.shape[1], intra_spec.group_size, pipeline),
        key=dict(seed=seed, step=step),
        bucket=bucket,
        backend=backend,
        stats=stats,
        node_average=node_average,
    )
    if split is None:
        return C.run_stages(plan.stages(output, op), async_op, result=output)

    def finish() -> None:
        if op == "avg":
            raw_out.div_(na * nb)
        split.put(output.view(1, -1), out.view(1, -1), raw_out.view(1, -1))

    stages = C.with_raw_part(
        plan.stages(out, op),
        lambda: C.reduce_scatter_sum(raw_out, raw.reshape(-1), group, stats, _NAME),
        finish,
    )
    return C.run_stages(stages, async_op, result=output)


def _check_raw_group(group: dist.ProcessGroup | None, mesh_size: int) -> None:
    """A split on two levels reduces its raw part over the flat group: it must be known."""
    if group is None and mesh_size != dist.get_world_size():
        raise ValueError(
            "hierarchical_reduce_scatter(split=...) on a mesh smaller than the world needs "
            "group=, the flat group whose layout the input follows (its raw part is "
            "reduced there)"
        )


def _one_level(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    layout: MeshLayout,
    shape: tuple[int, int],
    specs: tuple[QuantSpec, QuantSpec],
    node_average: Callable[[torch.Tensor], object] | None,
    op: str | dist.ReduceOp,
    stages_of: Callable[[torch.Tensor, dist.ProcessGroup, QuantSpec], C.Stages],
) -> C.Stages:
    """A mesh of one level: ``stages_of(input, group, spec)``, the flat reduce-scatter (eager
    or replayed) over the mesh's only group with that level's quantizer, ``input``'s chunks in
    the order that group numbers its ranks (a copy where it differs from the flat layout's,
    ``MeshLayout.sub_order``); ``node_average`` reported as :func:`_one_level_estimate` says."""
    na, nb = shape
    sub, spec = (layout.intra, specs[0]) if na == 1 else (layout.inter, specs[1])
    m = check_chunks(output, input, na * nb, _NAME)
    own = None
    if node_average is not None:  # (the own chunk before any reordering)
        own = input.reshape(na * nb, m)[layout.chunk_of(*layout.coord)]
    if layout.sub_order is not None:
        input = input.reshape(na * nb, m)[list(layout.sub_order)]
    stages = stages_of(input, sub, spec)
    if node_average is None:
        return stages
    node = dict(output=output, own=own, node_ranks=nb if na == 1 else 1)
    return _one_level_estimate(stages, node_average, op=C.parse_op(op), **node)


def _replayed(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    layout: MeshLayout,
    shape: tuple[int, int],
    group: dist.ProcessGroup | None,
    intra_spec: QuantSpec,
    inter_spec: QuantSpec,
    graphs: CodecGraphs,
    async_op: bool,
    pipeline: int,
    node_average: object,
    op: str | dist.ReduceOp,
    seed: int,
    step: int,
    bucket: int,
    hop: int,
    backend: Backend,
    stats: CommStats,
    name: str,
    split: Split | None,
) -> None:
    """The call replayed from ``graphs`` ([Note: two levels replayed] in ``_two_level``): on a
    mesh of one level the single-level reduce-scatter's site over its group."""
    for spec in (intra_spec, inter_spec):
        check_replayable(name, async_op=async_op, spec=spec, backend=backend)
    if pipeline != 1:
        raise ValueError(
            f"{name}(graphs=...) replays the hops of one piece; got pipeline={pipeline}: pass "
            "pipeline=1, or graphs=None"
        )
    C.check_key(seed, step, bucket)
    (na, nb), kw = shape, dict(split=split, op=op, seed=seed, bucket=bucket, backend=backend)
    if na == 1 or nb == 1:

        def stages_of(x: torch.Tensor, sub: dist.ProcessGroup, spec: QuantSpec) -> C.Stages:
            site = replayed_site(graphs, output, x, sub, spec=spec, hop=hop, name=name, **kw)
            site.run(output, x, step, stats, name)
            yield from ()

        specs = (intra_spec, inter_spec)
        C.run_stages(
            _one_level(
                output,
                input,
                layout=layout,
                shape=shape,
                specs=specs,
                node_average=node_average,
                op=op,
                stages_of=stages_of,
            ),
            False,
        )
        return
    if split is not None:
        _check_raw_group(group, na * nb)
    average = node_average is not None  # (the middle hop computes it: a segment of its own)
    site = graphs.site(
        name,
        group=group,
        input=input,
        output=output,
        layout=(layout, intra_spec, inter_spec, split, op),
        noise=(seed, bucket, average),
        make=lambda key: TwoLevelSite(
            graphs,
            key,
            (seed, bucket, average),
            output=output,
            input=input,
            layout=layout,
            shape=shape,
            group=group,
            intra_spec=intra_spec,
            inter_spec=inter_spec,
            average=average,
            name=name,
            **kw,
        ),
    )
    site.report = node_average
    try:
        site.run(output, input, step, stats, name)
    finally:
        site.report = None


def _with_own_raw(
    node_average: Callable[[torch.Tensor], object], split: Split, own_raw: torch.Tensor
) -> Callable[[torch.Tensor], object]:
    """``node_average`` of a split's compressed part, completed with the own raw values."""

    def call(compressed: torch.Tensor) -> None:
        full = torch.empty(1, split.chunk, dtype=torch.float32, device=compressed.device)
        split.put(full, compressed.view(1, -1), own_raw.to(torch.float32).view(1, -1))
        node_average(full.view(-1))

    return call


def _one_level_estimate(
    stages: C.Stages,
    node_average: Callable[[torch.Tensor], object],
    *,
    output: torch.Tensor,
    own: torch.Tensor,
    node_ranks: int,
    op: str,
) -> C.Stages:
    """``node_average`` on a mesh of one level: with one rank per node (``node_ranks`` 1) the
    own chunk, before the exchange; on one node the result's average, after it."""
    if node_ranks == 1:
        node_average(own.to(torch.float32, copy=True))
        yield from stages
        return
    yield from stages
    estimate = output.to(torch.float32, copy=True).view(-1)
    node_average(estimate if op == "avg" else estimate.div_(node_ranks))


@dataclass(kw_only=True)
class _Plan:
    """Buffers and steps of one two-level reduce-scatter (one object per call)."""

    chunks: torch.Tensor
    """The input as ``[N, m]``: row ``layout.chunk_of(a, b)`` is bound for coordinate ``(a, b)``."""
    layout: MeshLayout
    shape: tuple[int, int]
    """The mesh's ``(A, B)``."""
    intra_spec: QuantSpec
    inter_spec: QuantSpec
    pieces: list[tuple[int, int]]
    check: bool
    """Agree on NaN/Inf before the first exchange (the caller's spec raises): then every
    piece is encoded first (see [Note: NaN/Inf in a collective] in ``_common``)."""
    key: dict[str, int]
    """``seed`` and ``step`` of the noise."""
    bucket: int
    backend: Backend
    stats: CommStats
    node_average: Callable[[torch.Tensor], object] | None = None
    """Called with the own chunk's node average once the intra-node level is summed."""

    def __post_init__(self) -> None:
        self.a, self.b = self.layout.coord
        self.na, self.nb = self.shape
        self.inter, self.intra = self.layout.inter, self.layout.intra
        self.me = self.a * self.nb + self.b  # [Note: noise per place in the group]
        # The own chunk never travels: start the float32 sum from it, exact.
        self.acc = torch.empty(self.chunks.shape[1], dtype=torch.float32, device=self.chunks.device)
        self.acc.copy_(self.chunks[self.layout.chunk_of(self.a, self.b)])

    def _noise(self, hop: int, piece: int) -> Callable[[int], int]:
        """The noise stream of each input row's encode on ``hop`` in ``piece``."""
        me, bucket = self.me, self.bucket
        return lambda c: C.noise_stream(me, c, bucket=bucket, hop=hop, piece=piece)

    def _issue_intra(
        self, p: int, encoded: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, dist.Work]:
        """Encode piece ``p`` of every chunk for the local peers (unless ``encoded`` by
        :meth:`_encode_intra` already) and start the intra hop.

        Returns the ``[B, A, bytes]`` stack: rows ``0..B-2`` are the peers' payloads (filled by
        the all-to-all), row ``B-1`` this rank's own encodes (chunks of other nodes only).
        """
        stack, send = encoded or self._encode_intra(p)
        nbytes = stack.shape[2]
        me = self.layout.me_intra
        splits = [0 if j == me else self.na * nbytes for j in range(self.nb)]
        work = C.all_to_all(
            stack[: self.nb - 1].view(-1),
            send.view(-1),
            splits,
            splits,
            self.intra,
            self.stats,
            _NAME,
            stream="group",  # the pieces' hops overlap on the two groups' streams
        )
        return stack, work

    def _encode_intra(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(stack, send buffer) of piece ``p``, encoded, nothing sent."""
        o, n = self.pieces[p]
        nbytes = self.intra_spec.payload_bytes(n)
        stack = torch.empty(self.nb, self.na, nbytes, dtype=torch.uint8, device=self.acc.device)
        send = torch.empty(self.nb - 1, self.na, nbytes, dtype=torch.uint8, device=stack.device)
        encode_intra(
            self.chunks,
            (o, n),
            layout=self.layout,
            stack=stack,
            send=send,
            spec=self.intra_spec,
            stream_of=self._noise(0, p),
            backend=self.backend,
            **self.key,
        )
        return stack, send

    def _issue_inter(self, p: int, stack: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
        """Sum piece ``p`` of the node's chunks: the own one in place, the others re-encoded at
        the inter-node width and sent to their node."""
        o, n = self.pieces[p]
        nbytes = self.inter_spec.payload_bytes(n)
        send = torch.empty(self.na - 1, nbytes, dtype=torch.uint8, device=self.acc.device)
        recode(
            stack,
            self.acc[o : o + n],
            send,
            n,
            layout=self.layout,
            intra_spec=self.intra_spec,
            inter_spec=self.inter_spec,
            stream_of=self._noise(1, p),
            backend=self.backend,
            **self.key,
        )
        recv = torch.empty_like(send)
        me = self.layout.me_inter
        splits = [0 if j == me else nbytes for j in range(self.na)]
        return recv, C.all_to_all(
            recv.view(-1),
            send.view(-1),
            splits,
            splits,
            self.inter,
            self.stats,
            _NAME,
            stream="group",
        )

    def stages(self, output: torch.Tensor, op: str) -> C.Stages:
        encoded = [None] * len(self.pieces)
        if self.check:
            encoded = [self._encode_intra(p) for p in range(len(self.pieces))]
            bad = (~torch.isfinite(self.acc)).sum()
            others = [a2 for a2 in range(self.na) if a2 != self.a]  # the own slot is empty
            for (_, n), (stack, send) in zip(self.pieces, encoded, strict=True):
                bad = bad + flagged_groups(send.view(-1, send.shape[2]), n, self.intra_spec)
                bad = bad + flagged_groups(stack[self.nb - 1, others], n, self.intra_spec)
            C.agree_finite(bad, [self.intra, self.inter], self.stats, _NAME)
        pending = self._issue_intra(0, encoded[0]) if self.pieces else None
        inter = []
        for p in range(len(self.pieces)):
            stack, work = pending
            if p + 1 < len(self.pieces):
                # its encode overlaps the hop in flight
                pending = self._issue_intra(p + 1, encoded[p + 1])
            yield [work], False
            inter.append(self._issue_inter(p, stack))
        if self.node_average is not None:  # acc: the own chunk summed over the node
            self.node_average(self.acc / self.nb)
        yield [w for _, w in inter], True
        for (o, n), (recv, _) in zip(self.pieces, inter, strict=True):
            decode_inter(recv, self.acc[o : o + n], n, spec=self.inter_spec, backend=self.backend)
        C.finish_into(output, self.acc, op, self.na * self.nb)
