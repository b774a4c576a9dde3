"""SDP4Bit's weight-difference all-gather (qWD): send what changed, keep a shared reconstruction.

[Note: error feedback through the reconstruction]
Every rank holds the same reconstruction ``recon`` of the gathered tensor (``world_size`` shards
in the all-gather layout). Rank ``r`` encodes ``d = x_r - recon[r]`` (fused, one pass), one byte
all-gather moves the ``n`` payloads, and every rank, the sender included, adds every decoded
difference to its copy: ``recon[j] += decode(d_j)`` (in float32, rounded once to ``recon``'s
dtype). The next difference is taken against the updated reconstruction, so a quantization
error is sent again at the next call instead of accumulating: ``recon`` tracks ``x`` within one
step of the quantizer of the latest difference. With ``exact=True`` the shards travel
uncompressed and overwrite ``recon`` (the first gather, a resync). ``output`` receives
``recon``; all ranks hold bit-identical values.

    x_r -> d_r = x_r - recon[r] -> encode -> all-gather bytes -> recon[j] += decode(d_j) -> output

With ``graphs`` the difference gathers replay their encode and decode from CUDA graphs
([Note: codec segments replayed] in ``_graphs.py``): the reconstruction is the caller's state
at a fixed address, so each call site's two segments are keyed by it (its encode reads row
``r``, its decode adds into every row); the input, payload and step buffers are shared by the
sites of one shape. The exact gathers (the first, a resync) stay eager.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..quant import Backend, QuantSpec, decode_rows, encode_diff, flagged_groups
from . import _common as C
from ._calls import checked
from ._graphs import CodecGraphs, ReplayedSite, check_replayable, gather_buffers
from ._stats import CommStats

__all__ = ["all_gather_diff", "all_gather_diff_wire_bytes"]

_NAME = "all_gather_diff"


def all_gather_diff_wire_bytes(
    shard_numel: int, spec: QuantSpec, *, exact: bool = False, element_size: int = 4
) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`all_gather_diff` of a shard.

    Args:
        shard_numel: elements of each rank's input.
        spec: the differences' quantizer.
        exact: a full-precision gather (the first, a resync).
        element_size: bytes of one element of ``recon`` (what an exact gather sends).

    Returns:
        ``spec.payload_bytes(shard_numel)``, or ``shard_numel * element_size`` with ``exact``.
    """
    return shard_numel * element_size if exact else spec.payload_bytes(shard_numel)


@checked("all_gather_diff")
def all_gather_diff(
    output: torch.Tensor | None,
    input: torch.Tensor,
    recon: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    spec: QuantSpec,
    exact: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    backend: Backend = "auto",
    stats: CommStats | None = None,
    graphs: CodecGraphs | None = None,
) -> None:
    """All-gather of weight differences against ``recon``, which it updates in place.

    Error bound: after the call ``|recon - exact all-gather|`` is within one quantization step of
    ``spec`` on that call's differences (half a step with nearest rounding), plus the rounding to
    ``recon``'s dtype; the error of earlier calls is fed back, never summed.

    Args:
        output: ``world_size * input.numel()`` elements, the all-gather layout; receives
            ``recon``. It may share memory with ``input`` (FSDP's in-place layout). None:
            ``recon`` alone is updated (a gather made ahead of its use, served from ``recon``
            later).
        input: this rank's new shard (float32/bf16/fp16).
        recon: the reconstruction, same shape and dtype as ``output``; identical on all ranks
            (the state of the caller, who keeps it between calls). Read only with ``exact=True``.
        group: the process group (default: the world).
        spec: quantizer of the differences (SDP4Bit: 4-bit absmax, groups of 2048, stochastic).
        exact: send the shards uncompressed and reset ``recon`` to them.
        seed, step, bucket: noise key (give each call its own ``step``).
        backend: quantizer backend.
        stats: byte counter (default :data:`qsdp.comm.comm_stats`).
        graphs: replay the encode and decode of the difference gathers from CUDA graphs
            ([Note: codec segments replayed]; the same bits): CUDA tensors, a spec with
            ``nonfinite="propagate"``, the Triton backend. ``recon`` must stay where it is
            between calls (a new tensor is a new call site, captured anew).
    """
    C.check_spec(spec)
    for t, name in ((output, "output"), (input, "input"), (recon, "recon")):
        if t is not None:
            C.check_float(t, name)
    if output is not None:
        C.check_contiguous(output, "output")
    C.check_contiguous(recon, "recon")
    C.check_key(seed, step, bucket)
    pg, n, r = C.group_info(group)
    m = input.numel()
    like = recon if output is None else output
    if like.numel() != n * m or recon.shape != like.shape or recon.dtype != like.dtype:
        raise ValueError(
            f"all_gather_diff needs output and recon of {n} x {m} elements and one dtype; got "
            f"output shape {tuple(like.shape)}, recon shape {tuple(recon.shape)}, dtypes "
            f"{like.dtype} and {recon.dtype}"
        )
    stats = C.resolve_stats(stats)
    if graphs is not None:
        check_replayable(_NAME, async_op=False, spec=spec, backend=backend)
        if not exact and m:
            site = graphs.site(
                _NAME,
                group=pg,
                input=input,
                output=recon,
                layout=(spec, backend),
                # the segments read and write this reconstruction: keyed by where it is
                noise=(seed, bucket, recon.data_ptr()),
                make=lambda key: _Site(graphs, input, recon, pg, key, spec, seed, bucket, backend),
            )
            site.run(output, input, step, stats, _NAME)
            return
    stats.count_call(_NAME)
    if m == 0:
        return
    if exact:
        shard = input.reshape(-1).to(recon.dtype).contiguous()
        C.all_gather(recon.view(-1), shard, pg, stats, _NAME, stream="current")
        if output is not None:
            output.view(-1).copy_(recon.view(-1))
        return
    rows = recon.view(n, m)
    nbytes = spec.payload_bytes(m)
    send = torch.empty(nbytes, dtype=torch.uint8, device=input.device)
    enc_spec = spec.propagating()
    encode_diff(
        input.reshape(-1),
        rows[r],
        enc_spec,
        seed=seed,
        step=step,
        stream=C.noise_stream(C.noise_rank(pg), 0, bucket=bucket),
        out=send,
        backend=backend,
    )
    if enc_spec is not spec:  # every rank agrees before anything is exchanged
        C.agree_finite(flagged_groups(send, m, spec), [pg], stats, _NAME)
    recv = torch.empty(n * nbytes, dtype=torch.uint8, device=input.device)
    C.all_gather(recv, send, pg, stats, _NAME, stream="current")
    # every rank's difference onto its row of recon, one launch
    decode_rows(recv.view(n, nbytes), m, spec, out=rows, accumulate=True, backend=backend)
    if output is not None:
        output.view(-1).copy_(recon.view(-1))


class _Site(ReplayedSite):
    """One call site of a replayed weight-difference gather (a group's hook and its
    reconstruction; [Note: codec segments replayed] in ``_graphs.py``)."""

    def __init__(self, graphs, input, recon, pg, key, spec, seed, bucket, backend):
        n, r, m = pg.size(), pg.rank(), input.numel()
        nbytes = spec.payload_bytes(m)
        b = graphs.buffers(
            key,
            lambda: gather_buffers(m=m, row=nbytes, n=n, dtype=input.dtype, device=input.device),
        )
        noise = (seed, bucket, recon.data_ptr())
        super().__init__(graphs, key, noise, inp=b["inp"], out=recon, step=b["step"])
        self.decode_key = (key, noise, "decode")  # (it adds into this site's reconstruction)
        self.b, self.pg, self.n, self.nbytes, self.rows = b, pg, n, nbytes, recon.view(n, m)
        self.spec, self.seed, self.backend, self.r = spec, seed, backend, r
        self.stream = C.noise_stream(C.noise_rank(pg), 0, bucket=bucket)

    def encode(self) -> None:
        encode_diff(
            self.b["inp"],
            self.rows[self.r],
            self.spec,
            seed=self.seed,
            step=self.b["step"],
            stream=self.stream,
            out=self.b["send"],
            backend=self.backend,
        )

    def exchange(self, stats: CommStats) -> None:
        # on the current stream, after the encode ([Note: which stream an exchange runs on])
        C.all_gather(self.b["recv"], self.b["send"], self.pg, stats, _NAME, stream="current")

    def decode(self) -> None:
        recv, m = self.b["recv"].view(self.n, self.nbytes), self.rows.shape[1]
        decode_rows(recv, m, self.spec, out=self.rows, accumulate=True, backend=self.backend)
