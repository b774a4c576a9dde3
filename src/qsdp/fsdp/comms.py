"""qsdp's collectives behind FSDP2's custom all-gather / reduce-scatter protocol.

[Note: what FSDP2 hands us]
``FSDPModule.set_custom_all_gather(comm)`` makes FSDP2 call
``comm(output_tensor=, input_tensor=, group=, async_op=)`` with one flat buffer per parameter
group: ``input_tensor`` is this rank's shard, a view of ``output_tensor`` at ``rank * numel``.
:class:`QuantizedAllGather` encodes the shard, gathers bytes and decodes every shard into
``output_tensor``, the own one included, so all ranks compute on identical weights while the
sharded fp32 master stays exact. ``set_custom_reduce_scatter(comm)`` calls
``comm(output_tensor=, input_tensor=, group=, op=)`` with every gradient of the group laid out
rank-major; FSDP ignores the return value, so :class:`QuantizedReduceScatter` finishes before it
returns (on CUDA the work is enqueued on the current stream, FSDP's reduce-scatter stream). Both
use only these documented hooks; nothing of FSDP's internals is read or patched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .. import comm as qc
from ..comm._common import all_gather as counted_all_gather
from ..comm._common import noise_stream as qc_noise_stream
from ..comm._common import parse_op as qc_parse_op
from ..comm._common import reduce_scatter_sum as counted_reduce_scatter_sum
from ..quant import QuantSpec
from ..quant import decode as qc_decode
from ..quant import decode_sum as qc_decode_sum
from ..quant import encode as qc_encode
from ._split import Split

__all__ = [
    "QuantizedAllGather",
    "QuantizedMasterAllGather",
    "QuantizedReduceScatter",
    "StepClock",
    "WeightDiffAllGather",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Context:
    """Re-raise a ``torch.distributed`` failure (a peer gone, a timeout) with what qsdp was
    doing: which collective of which FSDP module."""

    def __init__(self, what: str, module: str) -> None:
        self.what, self.module = what, module

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if kind is not None and issubclass(kind, RuntimeError) and not str(err).startswith("qsdp"):
            raise RuntimeError(
                f"qsdp {self.what} of FSDP module '{self.module or '<root>'}' failed in "
                f"torch.distributed (a peer rank died, hung past the process group's timeout, or "
                f"the network failed): {err}"
            ) from err
        return False


def _usable(split: Split | None, chunk: int, stats: qc.CommStats) -> Split | None:
    """``split`` if it fits a chunk of ``chunk`` elements; else None, counted (see _split.py)."""
    if split is None:
        return None
    if split.chunk != chunk:
        stats.count_call("policy_skipped")
        return None
    return split


def _check_gather_dtype(t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"qsdp cannot quantize an all-gather of {t.dtype}: FSDP gathers raw bytes when a "
            "module's parameters mix dtypes; give them one dtype, or leave that module "
            "uncompressed"
        )


class StepClock:
    """Training steps as FSDP2 sees them, shared by a model's weight-difference all-gathers.

    ``tick`` runs before the root module's forward (a forward pre-hook): a gather in the same
    epoch as the last one (FSDP's backward re-gather) sees unchanged weights. ``request_resync``
    (after ``load_state_dict``, or by hand) makes every gather's next call exact.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.generation = 0

    def tick(self, *_: object) -> None:
        self.epoch += 1

    def request_resync(self, *_: object) -> None:
        self.generation += 1


class _Counter:
    """Calls so far: the ``step`` of the noise key (every rank makes the same calls in order)."""

    def __init__(self) -> None:
        self.calls = 0

    def next(self) -> int:
        step = self.calls % 2**32
        self.calls += 1
        return step


class QuantizedAllGather(AllGather):
    """FSDP2 all-gather through :func:`qsdp.comm.all_gather`."""

    def __init__(
        self,
        spec: QuantSpec,
        *,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        split: Split | None = None,
        module_name: str = "",
    ) -> None:
        self.spec, self.seed, self.bucket, self.stats = spec, seed, bucket, stats
        self.split, self.module_name = split, module_name
        self._steps = _Counter()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        with _Context("all-gather", self.module_name):
            return self._call(output_tensor, input_tensor, group)

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        _check_gather_dtype(input_tensor)
        # Always complete before returning: FSDP2 waits only on c10d ``Work`` objects, so a
        # returned qsdp handle would never be waited for. On CUDA "complete" means enqueued on
        # FSDP's all-gather stream, which keeps the overlap with compute.
        key = dict(seed=self.seed, step=self._steps.next(), bucket=self.bucket, stats=self.stats)
        split = _usable(self.split, input_tensor.numel(), self.stats)
        if split is None:
            qc.all_gather(output_tensor, input_tensor, group, spec=self.spec, **key)
            return None
        n = group.size()
        comp_idx, raw_idx = split.indices(input_tensor.device)
        comp = input_tensor.index_select(0, comp_idx)  # copies: input aliases output
        raw = input_tensor.index_select(0, raw_idx)
        comp_out = torch.empty(n * comp.numel(), dtype=comp.dtype, device=comp.device)
        raw_out = torch.empty(n * raw.numel(), dtype=raw.dtype, device=raw.device)
        if comp.numel():
            qc.all_gather(comp_out, comp, group, spec=self.spec, **key)
        if raw.numel():
            counted_all_gather(raw_out, raw, group, self.stats, "all_gather_raw").wait()
        rows = output_tensor.view(n, -1)
        rows.index_copy_(1, comp_idx, comp_out.view(n, -1))
        rows.index_copy_(1, raw_idx, raw_out.view(n, -1))
        return None


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2 gradient reduce-scatter through :func:`qsdp.comm.reduce_scatter` (a spec) or
    :func:`qsdp.comm.integer_reduce_scatter` (a Global-QSGD carrier)."""

    def __init__(
        self,
        *,
        spec: QuantSpec | None,
        carrier: str | None,
        group_size: int,
        seed: int,
        bucket: int,
        stats: qc.CommStats,
        inter_spec: QuantSpec | None = None,
        mesh: object | None = None,
        nonfinite: str = "raise",
        layout: list[tuple[str, int]] | None = None,
        split: Split | None = None,
        module_name: str = "",
    ) -> None:
        if (spec is None) == (carrier is None):
            raise ValueError("QuantizedReduceScatter needs exactly one of spec and carrier")
        if mesh is not None and inter_spec is None:
            raise ValueError("QuantizedReduceScatter(mesh=...) needs the inter-node inter_spec")
        # The check below (or "propagate") decides about NaN/Inf: the encoders must not raise
        # on one rank alone (its peers would wait for it until the timeout).
        self.spec = replace(spec, nonfinite="propagate") if spec is not None else None
        self.inter_spec = (
            replace(inter_spec, nonfinite="propagate") if inter_spec is not None else None
        )
        self.carrier, self.group_size, self.mesh = carrier, group_size, mesh
        self.nonfinite, self.layout, self.module_name = nonfinite, layout, module_name
        self.split = split
        self.zeroed = 0
        """Reduce-scatters whose gradient was zeroed for NaN/Inf (``nonfinite="zero"``)."""
        self.seed, self.bucket, self.stats = seed, bucket, stats
        self._steps = _Counter()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        with _Context("reduce-scatter", self.module_name):
            return self._call(output_tensor, input_tensor, group, op)

    def _call(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
    ) -> None:
        if self.nonfinite != "propagate" and self._nonfinite(input_tensor, group):
            output_tensor.zero_()
            self.zeroed += 1
            return None
        n = group.size()
        split = _usable(self.split, input_tensor.numel() // n, self.stats)
        if split is None:
            self._reduce(output_tensor, input_tensor, group, op)
            return None
        comp_idx, raw_idx = split.indices(input_tensor.device)
        rows = input_tensor.view(n, -1)
        comp = rows.index_select(1, comp_idx).reshape(-1)
        raw = rows.index_select(1, raw_idx).reshape(-1)
        comp_out = torch.empty(comp.numel() // n, dtype=comp.dtype, device=comp.device)
        raw_out = torch.empty(raw.numel() // n, dtype=raw.dtype, device=raw.device)
        if comp.numel():
            self._reduce(comp_out, comp, group, op)
        if raw.numel():
            counted_reduce_scatter_sum(raw_out, raw, group, self.stats, "reduce_scatter_raw").wait()
            if qc_parse_op(op) == "avg":
                raw_out.div_(n)
        output_tensor.index_copy_(0, comp_idx, comp_out)
        output_tensor.index_copy_(0, raw_idx, raw_out)
        return None

    def _reduce(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
    ) -> None:
        # AVG or SUM as FSDP asks; a PREMUL_SUM (set_gradient_divide_factor) raises with a fix.
        key = dict(seed=self.seed, step=self._steps.next(), bucket=self.bucket, stats=self.stats)
        if self.carrier is not None:
            qc.integer_reduce_scatter(
                output_tensor,
                input_tensor,
                group,
                carrier=self.carrier,
                op=op,
                group_size=self.group_size,
                **key,
            )
        elif self.mesh is not None:
            if group.size() != self.mesh.size():
                raise ValueError(
                    f"the two-level mesh has {self.mesh.size()} ranks but FSDP reduces over "
                    f"{group.size()}: shard the model over the same ranks as the mesh"
                )
            qc.hierarchical_reduce_scatter(
                output_tensor,
                input_tensor,
                mesh=self.mesh,
                intra_spec=self.spec,
                inter_spec=self.inter_spec,
                op=op,
                **key,
            )
        else:
            qc.reduce_scatter(output_tensor, input_tensor, group, spec=self.spec, op=op, **key)
        return None

    def _nonfinite(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
        """Agree across ranks whether a gradient of the group holds NaN/Inf: raise naming the
        parameters, or (``nonfinite="zero"``) return True so the caller zeroes the result."""
        flags = _nonfinite_flags(input_tensor.reshape(group.size(), -1), self.layout)
        self.stats.add_bytes("nonfinite_check", flags.numel() * flags.element_size())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        bad = flags.nonzero().reshape(-1).tolist()
        if not bad:
            return False
        if self.nonfinite == "zero":
            return True
        if self.layout is not None and len(self.layout) == flags.numel():
            where = ", ".join(self.layout[i][0] for i in bad)
        else:
            where = f"the parameters of FSDP module {self.module_name or '<root>'}"
        raise ValueError(
            f"non-finite gradient (NaN/Inf) on at least one rank in {where}; fix the source (a "
            "diverging loss, a missing grad clip or loss scale), or build the CompressionConfig "
            "with grad_nonfinite='zero' to zero these gradients for the step (counted)"
        )


class WeightDiffAllGather(AllGather):
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
        resync_every: int = 0,
        check_replicas: bool = False,
        module_name: str = "",
    ) -> None:
        self.spec, self.seed, self.bucket, self.stats = spec, seed, bucket, stats
        self.module_name = module_name
        self.clock, self.resync_every, self.check_replicas = clock, resync_every, check_replicas
        self.recon: torch.Tensor | None = None
        self._epoch = -1
        self._generation = -1
        self._diffs = 0
        self._steps = _Counter()
        self.cached_gathers = 0
        """Gathers served from the reconstruction without communication (FSDP's re-gathers)."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        with _Context("all-gather", self.module_name):
            return self._call(output_tensor, input_tensor, group)

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        _check_gather_dtype(input_tensor)
        fresh = self.recon is None or self.recon.shape != output_tensor.shape
        if not fresh and self.clock.epoch == self._epoch:
            output_tensor.copy_(self.recon)  # weights unchanged since the last gather
            self.cached_gathers += 1
            return None
        exact = (
            fresh
            or self._generation != self.clock.generation
            or (self.resync_every > 0 and self._diffs >= self.resync_every)
        )
        if fresh or self.recon.dtype != output_tensor.dtype:
            self.recon = torch.empty_like(output_tensor)
        qc.all_gather_diff(
            output_tensor,
            input_tensor,
            self.recon,
            group,
            spec=self.spec,
            exact=exact,
            seed=self.seed,
            step=self._steps.next(),
            bucket=self.bucket,
            stats=self.stats,
        )
        self._diffs = 0 if exact else self._diffs + 1
        self._epoch, self._generation = self.clock.epoch, self.clock.generation
        if self.check_replicas:
            _check_replicas(self.recon, group)
        return None


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


def _nonfinite_flags(chunks: torch.Tensor, layout: list[tuple[str, int]] | None) -> torch.Tensor:
    """Per-parameter flags (int32) of NaN/Inf in the rank-major ``[world, M]`` gradient input
    (one flag for the whole group when the layout does not match)."""
    bad = (~torch.isfinite(chunks)).any(dim=0)
    if layout is None or sum(n for _, n in layout) != bad.numel():
        return bad.any().reshape(1).to(torch.int32)
    segments = torch.split(bad, [n for _, n in layout])
    return torch.stack([seg.any() for seg in segments]).to(torch.int32)


class QuantizedMasterAllGather(AllGather):
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
        self.spec, self.seed, self.bucket, self.stats = spec, seed, bucket, stats
        self.clock, self.params, self.module_name = clock, params, module_name
        self._epoch = -1
        self._recv: torch.Tensor | None = None
        self._steps = _Counter()
        self.cached_gathers = 0

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        with _Context("all-gather", self.module_name):
            return self._call(output_tensor, input_tensor, group)

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        n, m = group.size(), input_tensor.numel()
        nbytes = self.spec.payload_bytes(m)
        if self._recv is None or self._epoch != self.clock.epoch:
            if input_tensor.dtype != torch.float32 or any(
                p.dtype != torch.float32 for p, _ in self.params
            ):
                raise ValueError(
                    "the quantized-master recipe gathers the fp32 master itself: drop "
                    "MixedPrecisionPolicy(param_dtype=...) for these modules"
                )
            step = self._steps.next()
            send = torch.empty(nbytes, dtype=torch.uint8, device=input_tensor.device)
            enc = qc_encode(
                input_tensor,
                self.spec,
                seed=self.seed,
                step=step,
                stream=qc_noise_stream(dist.get_rank(), 0, bucket=self.bucket),
                out=send,
            )
            self._write_master(qc_decode(enc))
            self._recv = torch.empty(n * nbytes, dtype=torch.uint8, device=send.device)
            counted_all_gather(self._recv, send, group, self.stats, "all_gather_master").wait()
            self._epoch = self.clock.epoch
        else:
            self.cached_gathers += 1
        rows = self._recv.view(n, nbytes)
        flat = output_tensor.view(n, m)
        for j in range(n):
            qc_decode_sum(rows[j : j + 1], m, self.spec, out=flat[j])
        return None

    @torch.no_grad()
    def _write_master(self, values: torch.Tensor) -> None:
        """Copy the projected shard into the master parameters (their padded segments)."""
        offset = 0
        for p, padded in self.params:
            local = p.to_local().view(-1)
            local.copy_(values[offset : offset + local.numel()])
            offset += padded
