"""Quantized all-gather: each rank's shard travels as one payload, every rank decodes them all.

Rank ``r`` encodes its shard once (codes and scales in one ``uint8`` buffer), one byte all-gather
moves the ``n`` payloads, and every rank decodes every payload, its own included, into the layout
of ``dist.all_gather_into_tensor``. Since all ranks decode the same bytes with the same code, all
replicas hold bit-identical results (the property sharded training needs of its weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..quant import Backend, QuantSpec, decode_rows, encode, flagged_groups
from . import _common as C
from ._calls import checked
from ._graphs import CodecGraphs, ReplayedSite, check_replayable, gather_buffers
from ._split import Split, check_split, fused_parts, fused_row
from ._stats import CommStats

__all__ = ["all_gather", "all_gather_payloads", "all_gather_wire_bytes"]

_NAME = "all_gather"


def all_gather_wire_bytes(
    shard_numel: int, spec: QuantSpec, *, split: Split | None = None, element_size: int = 4
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`all_gather` of a shard.

    Args:
        shard_numel: elements of each rank's input.
        spec: the quantizer.
        split: as passed to :func:`all_gather` (its raw elements travel as bytes).
        element_size: bytes of one input element (the raw part's width).

    Returns:
        ``spec.payload_bytes(shard_numel)``; with a split the ``[codes | raw]`` row of
        :func:`~qsdp.comm.fused_row` (the uncompressed all-gather sends ``shard_numel *
        element_size``).
    """
    if split is None:
        return spec.payload_bytes(shard_numel)
    return fused_row(spec, split.n_comp, split.n_raw * element_size)[1]


@checked("all_gather")
def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    spec: QuantSpec,
    split: Split | None = None,
    async_op: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    backend: Backend = "auto",
    stats: CommStats | None = None,
    graphs: CodecGraphs | None = None,
) -> C.CommWork | None:
    """Quantized ``dist.all_gather_into_tensor``: ``output`` holds every rank's decoded shard.

    Error bound (per element ``i`` of shard ``j``, against the exact all-gather): nearest
    rounding ``|out - x_j| <= step/2``, stochastic ``< step`` and unbiased, where ``step`` is the
    quantization step of ``i``'s group on rank ``j`` (``spec.step_bound()``, e.g.
    ``max|x_group| / qmax`` for absmax); with Hadamard the bound holds in the rotated domain
    (per block, in L2). Add the rounding to ``output``'s dtype. Results are bit-identical on all
    ranks.

    Args:
        output: tensor of ``world_size * input.numel()`` elements, float32/bf16/fp16, contiguous;
            rank ``j``'s shard lands at ``output.view(-1)[j * m:(j + 1) * m]``.
        input: this rank's shard (any shape, any float dtype); it is encoded before the call
            returns, so it may be reused at once.
        group: the process group (default: the world).
        spec: the quantizer, the same on every rank.
        split: which runs of the shard travel raw (exact) beside the codes, in the same
            all-gather (see [Note: policies inside flat buffers]); ``split.chunk`` must equal
            ``input.numel()``. ``output`` and ``input`` may then alias (FSDP2's layout).
        async_op: return a :class:`CommWork` whose ``wait()`` finishes the gather and decodes.
        seed, step: key of the stochastic-rounding noise (the step counter of the training loop);
            the same on every rank, so runs are reproducible. Each rank's noise stream is
            derived from its global rank and ``bucket``.
        bucket: separates buffers gathered in the same step (e.g. FSDP parameter groups).
        backend: the quantizer backend (``"auto"``: Triton on CUDA, reference on CPU).
        stats: the byte counter to record into (default :data:`qsdp.comm.comm_stats`).
        graphs: replay the encode and the decode from CUDA graphs captured in it at the first
            call of each shape and noise key, the same bits ([Note: codec segments replayed]
            in ``qsdp.comm._graphs``): a synchronous call, a ``spec`` with
            ``nonfinite="propagate"``, the Triton backend.

    Returns:
        A :class:`CommWork` when ``async_op``, else None.
    """
    if graphs is not None:  # [Note: codec segments replayed]
        check_replayable(_NAME, async_op=async_op, spec=spec, backend=backend)
        site = replayed_site(
            graphs,
            output,
            input,
            group,
            spec=spec,
            split=split,
            seed=seed,
            bucket=bucket,
            backend=backend,
        )
        C.check_key(seed, step, bucket)
        site.run(output, input, step, C.resolve_stats(stats), _NAME)
        return None
    stages = _all_gather_stages(
        output,
        input,
        group,
        spec=spec,
        split=split,
        seed=seed,
        step=step,
        bucket=bucket,
        hop=0,
        backend=backend,
        stats=C.resolve_stats(stats),
        name=_NAME,
    )
    return C.run_stages(stages, async_op, result=output)


def _all_gather_stages(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    spec: QuantSpec,
    seed: int,
    step: int,
    bucket: int,
    hop: int,
    backend: Backend,
    stats: CommStats,
    name: str,
    split: Split | None = None,
    count_call: bool = True,
) -> C.Stages:
    """Validate and encode now (not on the first ``next``), and return the stage generator."""
    C.check_spec(spec)
    C.check_key(seed, step, bucket)
    pg, n, _ = C.group_info(group)
    m = _check_shapes(output, input, n, split)
    if count_call:
        stats.count_call(name)
    if split is not None:
        return _fused_stages(
            output, input, pg, n, spec, split, seed, step, bucket, hop, backend, stats, name
        )
    nbytes = spec.payload_bytes(m)
    send = torch.empty(nbytes, dtype=torch.uint8, device=input.device)
    enc_spec = spec.propagating()
    encode(
        input,
        enc_spec,
        seed=seed,
        step=step,
        out=send,
        backend=backend,
        stream=C.noise_stream(C.noise_rank(pg), 0, bucket=bucket, hop=hop),
    )
    if enc_spec is not spec:  # every rank agrees before anything is exchanged
        C.agree_finite(flagged_groups(send, m, spec), [pg], stats, name)
    return _gather_decode(output, send, pg, n, m, spec, backend, stats, name)


def _check_shapes(output, input, n: int, split: Split | None) -> int:
    """Validate an all-gather's tensors over ``n`` ranks; returns the shard's length."""
    C.check_float(input, "input")
    C.check_float(output, "output")
    C.check_contiguous(output, "output")
    C.check_same_device(output, input, "output and input")
    m = input.numel()
    if output.numel() != n * m:
        raise ValueError(
            f"output has {output.numel()} elements; all_gather of {m} elements over {n} ranks "
            f"needs world_size * input.numel() = {n * m}"
        )
    if split is not None:
        check_split(split, m, "the input")
    return m


def _gather_decode(output, send, pg, n, m, spec, backend, stats, name) -> C.Stages:
    if m == 0:
        return
    nbytes = send.numel()
    recv = torch.empty(n * nbytes, dtype=torch.uint8, device=send.device)
    yield [C.all_gather(recv, send, pg, stats, name)], True
    decode_rows(recv.view(n, nbytes), m, spec, out=output.view(n, m), backend=backend)


def _fused_stages(
    output, input, pg, n, spec, split, seed, step, bucket, hop, backend, stats, name
) -> C.Stages:
    """A policy split's all-gather: ``[codes | raw bytes]`` rows in one ``torch.distributed``
    call, decoded and put back in place (``input`` may alias ``output``: it is read into the send
    buffer before anything is written)."""
    raw_bytes = split.n_raw * input.element_size()
    _, row, parts = fused_parts(spec, split.n_comp, raw_bytes)
    # (the parts' padding is never read: no zeroing)
    send = torch.empty(row, dtype=torch.uint8, device=input.device)
    enc_spec = spec.propagating()
    stream = C.noise_stream(C.noise_rank(pg), 0, bucket=bucket, hop=hop)
    comp, raw, codes = _encode_fused(
        input, send, split, parts, enc_spec, seed=seed, step=step, stream=stream, backend=backend
    )
    if enc_spec is not spec:  # every rank agrees before anything is exchanged
        bad = flagged_groups(codes, comp.numel(), spec) + (~torch.isfinite(raw)).sum()
        C.agree_finite(bad, [pg], stats, name)
    if split.chunk == 0:
        return
    recv = torch.empty(n * row, dtype=torch.uint8, device=send.device)
    yield [C.all_gather(recv, send, pg, stats, name)], True
    _decode_fused(recv, output, n, split, parts, spec, input.dtype, backend)


def _encode_fused(input, send, split, parts, spec, *, seed, step, stream, backend, comp_out=None):
    """The shard's ``[codes | raw]`` row into ``send`` (cut by ``parts``); returns the
    compressed part it encoded (taken into ``comp_out`` when given, ``[1, n_comp]``, where the
    split has several runs), the raw part it sent and the codes' part of ``send``."""
    rows = input.reshape(1, -1)  # read before the exchange, never written
    # the row's parts as views, cut once per call ([Note: a split's plan] in _split.py)
    codes, _, raw_slot, _ = send.split_with_sizes(parts)
    if split.one_run_each:  # views of the input: the raw run copied into its slot
        comp, raw = (part.reshape(-1) for part in split.views(rows))
        raw_slot.copy_(raw.view(torch.uint8))
    else:  # the raw runs gathered straight into their slot (16-byte aligned: a float view)
        raw = raw_slot.view(input.dtype)
        comp = split.take(rows, comp_out=comp_out, raw_out=raw.view(1, -1))[0].view(-1)
    if comp.numel():
        # (``step`` an int, or one int64 in device memory: a replayed segment's)
        encode(comp, spec, seed=seed, step=step, stream=stream, out=codes, backend=backend)
    return comp, raw, codes


def _decode_fused(recv, output, n, split, parts, spec, dtype, backend) -> None:
    """Every rank's ``[codes | raw]`` row of ``recv`` decoded into its place in ``output``
    (the shards' dtype: ``dtype``)."""
    got_codes, _, got_raw, _ = recv.view(n, -1).split_with_sizes(parts, dim=1)
    raw_out = got_raw.view(dtype)  # (16-byte aligned rows: a view)
    if split.one_run_each and output.dtype == dtype:
        # each part one run of every row: decoded straight into the output's rows (strided),
        # the raw values copied into theirs (the bits of the temporary and the put below)
        comp_dst, raw_dst = split.views(output.view(n, -1))
        if split.n_comp:
            decode_rows(got_codes, split.n_comp, spec, out=comp_dst, backend=backend)
        if split.n_raw:
            raw_dst.copy_(raw_out)
        return
    comp_out = torch.empty(n, split.n_comp, dtype=dtype, device=recv.device)
    if split.n_comp:
        decode_rows(got_codes, split.n_comp, spec, out=comp_out, backend=backend)
    split.put(output.view(n, -1), comp_out, raw_out)


def replayed_site(
    graphs: CodecGraphs,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    spec: QuantSpec,
    split: Split | None,
    seed: int,
    bucket: int,
    backend: Backend,
    hop: int = 0,
    name: str = _NAME,
) -> _Site:
    """The replayed all-gather's site of this call (made at its first call): ``hop`` and
    ``name`` as a composite call's phase runs it (CGX's phase 2: its noise and byte counter)."""
    return graphs.site(
        _NAME,
        group=group,
        input=input,
        output=output,
        layout=(spec, split, name),
        noise=(seed, bucket, hop),
        make=lambda key: _Site(
            graphs, output, input, group, key, spec, split, seed, bucket, backend, hop, name
        ),
    )


class _Site(ReplayedSite):
    """One call site of a replayed all-gather (a group's hook)
    ([Note: codec segments replayed] in ``_graphs.py``)."""

    def __init__(
        self, graphs, output, input, group, key, spec, split, seed, bucket, backend, hop, name
    ):
        pg, n, _ = C.group_info(group)
        m = _check_shapes(output, input, n, split)
        if split is not None:
            _, row, parts = fused_parts(spec, split.n_comp, split.n_raw * input.element_size())
        else:
            row, parts = spec.payload_bytes(m), None
        device = input.device

        def make() -> dict[str, torch.Tensor]:
            return {
                **gather_buffers(m=m, row=row, n=n, dtype=input.dtype, device=device),
                "out": torch.empty(n * m, dtype=output.dtype, device=device),
                # a split's compressed runs side by side (not in each segment's own pool)
                "comp": torch.empty(
                    1, split.n_comp if split else 0, dtype=input.dtype, device=device
                ),
            }

        b = graphs.buffers(key, make)
        super().__init__(
            graphs, key, (seed, bucket, hop), inp=b["inp"], out=b["out"], step=b["step"]
        )
        self.b, self.pg, self.n, self.row, self.parts = b, pg, n, row, parts
        self.name = name
        self.spec, self.split, self.seed, self.backend = spec, split, seed, backend
        self.dtype = input.dtype
        self.stream = C.noise_stream(C.noise_rank(pg), 0, bucket=bucket, hop=hop)

    def encode(self) -> None:
        b, spec = self.b, self.spec
        kw = {"seed": self.seed, "step": b["step"], "stream": self.stream, "backend": self.backend}
        if self.split is None:
            encode(b["inp"], spec, out=b["send"], **kw)
        else:
            _encode_fused(
                b["inp"], b["send"], self.split, self.parts, spec, comp_out=b["comp"], **kw
            )

    def exchange(self, stats: CommStats) -> None:
        # on the current stream, after the encode ([Note: which stream an exchange runs on])
        C.all_gather(self.b["recv"], self.b["send"], self.pg, stats, self.name, stream="current")

    def decode(self) -> None:
        b, n = self.b, self.n
        if self.split is None:
            m = self.inp.numel()
            out = b["out"].view(n, m)
            decode_rows(b["recv"].view(n, self.row), m, self.spec, out=out, backend=self.backend)
        else:
            _decode_fused(
                b["recv"], b["out"], n, self.split, self.parts, self.spec, self.dtype, self.backend
            )


@checked("all_gather_payloads")
def all_gather_payloads(
    payload: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    stats: CommStats | None = None,
    name: str = _NAME,
) -> torch.Tensor:
    """All-gather one encoded payload per rank, counted: for callers that encode themselves
    (QSDP's quantized master keeps the gathered payloads and decodes them again later).

    Args:
        payload: this rank's 1-D uint8 payload (the same length on every rank).
        group: the process group (default: the world).
        stats: the byte counter (default :data:`qsdp.comm.comm_stats`), under ``name``.

    Returns:
        ``[world_size, payload.numel()]`` uint8 rows, rank ``j``'s payload in row ``j``
        (decode them with :func:`qsdp.quant.decode_rows`).
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload must be 1-D uint8, got {payload.dtype=} {payload.dim()=}")
    pg, n, _ = C.group_info(group)
    stats = C.resolve_stats(stats)
    stats.count_call(name)
    recv = torch.empty(n, payload.numel(), dtype=torch.uint8, device=payload.device)
    if payload.numel():
        C.all_gather(recv.view(-1), payload, pg, stats, name, stream="current")
    return recv
