"""Public encode / decode of tensors into wire payloads, dispatching to a backend.

``reference`` is plain torch (any device, the specification); ``triton`` runs the fused kernels
(CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``auto`` picks triton on CUDA and the
reference elsewhere. There is no silent fallback: a backend that cannot run raises.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from . import reference as ref
from ._tables import on_device
from .spec import NonFinite, QuantSpec, Scheme

__all__ = [
    "Backend",
    "Encoded",
    "decode",
    "decode_add",
    "decode_rows",
    "decode_sum",
    "decode_sum_encode",
    "encode",
    "cut_runs",
    "encode_diff",
]

Backend = Literal["auto", "reference", "triton"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Encoded:
    """A quantized tensor: one contiguous ``uint8`` payload (scales then packed codes)."""

    payload: torch.Tensor
    """The bytes that go on the wire (1-D ``uint8``, ``spec.payload_bytes(numel)`` long)."""
    numel: int
    """Elements of the original tensor."""
    dtype: torch.dtype
    """Dtype :func:`decode` returns."""
    spec: QuantSpec
    """The quantizer that made the payload."""
    shape: torch.Size | None = None
    """Shape :func:`decode` returns (default: 1-D of ``numel``)."""

    def __post_init__(self) -> None:
        p = self.payload
        expect = self.spec.payload_bytes(self.numel)
        if p.dtype != torch.uint8 or p.dim() != 1 or p.numel() != expect:
            raise ValueError(
                f"Encoded payload must be 1-D uint8 of {expect} bytes for numel={self.numel} "
                f"and spec {self.spec}; got {p.dtype=} {tuple(p.shape)=}"
            )
        if self.shape is not None and torch.Size(self.shape).numel() != self.numel:
            raise ValueError(f"Encoded shape={tuple(self.shape)} does not hold numel={self.numel}")

    @property
    def wire_bytes(self) -> int:
        """Bytes this tensor puts on the wire (the payload's size)."""
        return self.payload.numel()


# --- argument checks --------------------------------------------------------------------------
def _check_float(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; qsdp quantizes float32, bfloat16 and float16 tensors"
        )


def _check_counter(name: str, value: int, bits: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**bits:
        raise ValueError(f"{name}={value!r} must be an int in [0, 2**{bits})")


def _check_rng(seed: int, step: int, stream: int) -> None:
    _check_counter("seed", seed, 64)
    _check_counter("step", step, 32)
    _check_counter("stream", stream, 32)


def _check_device_step(
    step: torch.Tensor, device: torch.device, kernel: bool, what: str = "encode_rows"
) -> None:
    """A step the kernel reads from memory: one int64 beside the input, on the Triton path."""
    if step.dtype != torch.int64 or step.numel() != 1 or step.device != device or not kernel:
        raise ValueError(
            f"{what}: a step in device memory must be one int64 on the input's device "
            f"({device}) read by the Triton kernel with nonfinite='propagate'; got "
            f"{step.dtype} of {step.numel()} elements on {step.device}"
            + ("" if kernel else ", on a path without that kernel: pass the step as an int")
        )


@functools.lru_cache(maxsize=4096)
def _check_streams(streams: tuple[int, ...]) -> None:
    """Each of ``streams`` a valid noise stream (checked once per tuple: a reduce-scatter
    passes the same ``n - 1`` streams on every call)."""
    for stream in streams:
        _check_counter("stream", stream, 32)


def _resolve(backend: Backend, device: torch.device) -> str:
    if backend == "auto":
        if device.type == "cuda":
            _require_triton()
            return "triton"
        return "reference"
    if backend == "reference":
        return backend
    if backend == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' on a CPU tensor needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported, or use backend='reference'"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' runs on CUDA (or CPU interpreted), not {device}")
        _require_triton()
        return backend
    raise ValueError(f"backend={backend!r} must be 'auto', 'reference' or 'triton'")


def _require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "qsdp's CUDA kernels need triton: pip install 'qsdp[triton]', or pass "
            "backend='reference' to run the pure-torch quantizer"
        ) from e


def _launch():
    from ._triton import launch

    return launch


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)


def _raise_nonfinite(
    payload: torch.Tensor,
    spec: QuantSpec,
    src: torch.Tensor,
    base: torch.Tensor | None,
    numel: int,
) -> None:
    """Raise if any group was flagged (its first scale field is NaN); what to say is worked out
    from ``src`` (minus ``base``) only then."""
    if spec.nonfinite is NonFinite.PROPAGATE or numel == 0:
        return
    ng = spec.num_groups(numel)
    raw = payload[: ng * spec.scale_bytes]
    if raw.storage_offset() % spec.scale_dtype.itemsize == 0:
        first = raw.view(spec.scale_dtype)[:: spec.scale_fields]  # no copy: a view of the scales
    else:
        first = ref._bytes_to_fields(raw, ng, spec)[:, 0]
    flagged = torch.isnan(first)
    if bool(flagged.any()):
        raise ValueError(_flagged_message(spec, src, base, flagged))


def _flagged_message(
    spec: QuantSpec, src: torch.Tensor, base: torch.Tensor | None, flagged: torch.Tensor
) -> str:
    """Why encode flagged groups: NaN/Inf in the source, a difference ``x - base`` that
    overflows, or finite values too large for the scheme (reference's
    [Note: representable range])."""
    x = src.float() if base is None else src.float() - base.float()
    numel, ng, g = x.numel(), flagged.numel(), spec.group_size
    nonfinite = ~torch.isfinite(x)
    count = int(nonfinite.sum())
    padded = torch.zeros(ng * g, dtype=torch.bool, device=x.device)
    padded[:numel] = nonfinite
    too_large = int((flagged.to(x.device) & ~padded.reshape(ng, g).any(dim=1)).sum())
    what = "|x|" if base is None else "|x - base|"
    limit = spec.value_limit()
    fix = _range_fix(spec)
    if count:
        inputs_finite = base is not None and bool(
            torch.isfinite(src.float()).all() & torch.isfinite(base.float()).all()
        )
        if inputs_finite:
            head = (
                f"cannot quantize: x - base overflows float32 in {count} of {numel} values "
                f"({spec}); scale both tensors down, or encode x itself"
            )
        else:
            head = (
                f"cannot quantize: {count} of {numel} values are NaN or Inf ({spec}); fix the "
                "source (a diverging loss, a missing grad clip)"
            )
        more = ""
        if too_large:
            more = (
                f"; also too large for this scheme: {too_large} group(s) of finite values "
                f"({what} <= {limit:.4g} always encodes)"
            )
        return (
            f"{head}{more}, or build the QuantSpec with nonfinite='propagate' to send the "
            "affected groups as NaN"
        )
    # only an overflow flags a group of finite values: the step floor keeps tiny groups
    # encodable (reference's [Note: step floor])
    largest = float(x.abs().max())
    return (
        f"cannot quantize: {too_large} of {ng} groups hold finite values too large for {spec} "
        f"(largest {what} = {largest:.4g}; this quantizer encodes every {what} <= {limit:.4g}, "
        "larger values only while the group's decoded range fits float32); scale the tensor "
        f"down (a smaller loss scale, a grad clip), keep {what} <= {limit:.4g}, {fix}, or build "
        "the QuantSpec with nonfinite='propagate' to send these groups as NaN"
    )


def _range_fix(spec: QuantSpec) -> str:
    """The spec change that encodes every finite value (absmax, no Hadamard)."""
    if spec.scheme is not Scheme.ABSMAX and spec.hadamard_block:
        return "use scheme='absmax' with hadamard_block=None (every finite value encodes)"
    if spec.scheme is not Scheme.ABSMAX:
        return "use scheme='absmax' (every finite value encodes)"
    return "use hadamard_block=None (absmax then encodes every finite value)"


# --- public API -------------------------------------------------------------------------------
def encode(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    seed: int = 0,
    step: int | torch.Tensor = 0,
    stream: int = 0,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> Encoded:
    """Quantize ``x`` into one payload.

    Args:
        x: float32, bfloat16 or float16 tensor of any shape and layout (empty allowed).
        spec: the quantizer.
        seed, step, stream: key and counter words of the stochastic-rounding noise (and of the
            shift-lattice dither, which uses ``seed`` and ``step`` only, so ranks share it).
            Same inputs and key give the same bytes on every run and backend. ``step`` may
            also be one int64 on ``x``'s device, read by the Triton kernel when it runs (a
            launch a CUDA graph replays draws each replay's noise; ``nonfinite="propagate"``
            only), as for :func:`encode_rows`.
        out: optional 1-D uint8 tensor of ``spec.payload_bytes(x.numel())`` bytes to write into
            (e.g. a slice of an all-to-all send buffer).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        The :class:`Encoded` tensor; ``wire_bytes`` is its payload size.

    Raises:
        ValueError: NaN or Inf in ``x``, or a group of finite values too large for ``spec``
            (beyond ``spec.value_limit()``, where its decoded range would overflow float32),
            unless ``spec.nonfinite == "propagate"``; bad counters.
    """
    return _encode(x, None, spec, seed=seed, step=step, stream=stream, out=out, backend=backend)


def encode_diff(
    x: torch.Tensor,
    base: torch.Tensor,
    spec: QuantSpec,
    *,
    seed: int = 0,
    step: int | torch.Tensor = 0,
    stream: int = 0,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> Encoded:
    """Quantize ``x - base`` (float32 difference) in one pass: SDP4Bit's weight differences.
    Arguments as :func:`encode`'s (a step in device memory too)."""
    _check_float(base, "base")
    if base.shape != x.shape:
        raise ValueError(f"encode_diff needs equal shapes; got {x.shape=} {base.shape=}")
    if base.device != x.device:
        raise ValueError(f"encode_diff needs one device; got {x.device=} {base.device=}")
    return _encode(x, base, spec, seed=seed, step=step, stream=stream, out=out, backend=backend)


def _encode(x, base, spec, *, seed, step, stream, out, backend) -> Encoded:
    _check_float(x, "x")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    triton = _resolve(backend, x.device) == "triton"
    if isinstance(step, torch.Tensor):  # (read by the kernel: a launch a CUDA graph replays)
        kernel = triton and spec.nonfinite is NonFinite.PROPAGATE
        _check_device_step(step, x.device, kernel, "encode" if base is None else "encode_diff")
        _check_rng(seed, 0, stream)
    else:
        _check_rng(seed, step, stream)
    numel = x.numel()
    out = _payload_out(out, numel, spec, x.device)
    src = _flat(x)
    rsrc = _flat(base) if base is not None else None
    if triton:
        _launch().encode(
            src, spec=spec, out=out, ref=rsrc, seed=seed, step=step, stream=stream, rotate=True
        )
    else:
        diff = src.float() if rsrc is None else src.float() - rsrc.float()
        out.copy_(ref.encode_flat(diff, spec, seed=seed, step=step, stream=stream))
    _raise_nonfinite(out, spec, src, rsrc, numel)
    return Encoded(payload=out, numel=numel, dtype=x.dtype, spec=spec, shape=x.shape)


def encode_rows(
    rows: torch.Tensor,
    spec: QuantSpec,
    *,
    out: torch.Tensor,
    streams: Sequence[int],
    skip: int | None = None,
    seed: int = 0,
    step: int | torch.Tensor = 0,
    backend: Backend = "auto",
) -> None:
    """Quantize every row of ``rows`` but row ``skip`` into the rows of ``out``, in order: row
    ``s`` of ``out`` holds exactly what ``encode(row, spec, stream=streams[s], ...)`` writes,
    in one kernel launch on the Triton backend (a reduce-scatter's ``n - 1`` destination
    chunks, where a launch per chunk cost the host one each).

    Args:
        rows: ``[k, m]`` float32/bf16/fp16 with unit column stride (rows may be strided).
        spec: the quantizer.
        out: uint8 ``[k - 1, >= payload_bytes(m)]`` (``[k, ...]`` when ``skip`` is None) with
            unit column stride: each row's payload starts at the row's first byte.
        streams: the noise stream of each written row, in ``out``'s row order.
        skip: the row not encoded (a rank's own chunk), or None.
        seed, step, backend: as for :func:`encode`; ``step`` may also be one int64 on
            ``rows``' device, which the Triton kernel reads when it runs (a launch a CUDA graph
            replays draws each replay's noise; ``nonfinite="propagate"`` only).

    Raises:
        ValueError: shapes that do not match; as :func:`encode` for values it cannot quantize
            (only with ``nonfinite="raise"``; a reduce-scatter encodes with ``"propagate"``).
    """
    _check_float(rows, "rows")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    k, m = rows.shape if rows.dim() == 2 else (-1, -1)
    slots = k - (skip is not None)
    nbytes = spec.payload_bytes(max(m, 0))
    if (
        rows.dim() != 2
        or (rows.numel() and rows.stride(1) != 1)
        or (skip is not None and not 0 <= skip < k)
        or out.dtype != torch.uint8
        or out.dim() != 2
        or out.shape[0] != slots
        or out.shape[1] < nbytes
        or (out.numel() and out.stride(1) != 1)
        or len(streams) != slots
        or out.device != rows.device
    ):
        raise ValueError(
            f"encode_rows: rows {tuple(rows.shape)} (strides {rows.stride()}), skip={skip}, "
            f"out {out.dtype} {tuple(out.shape)} on {out.device}, {len(streams)} streams: "
            f"rows must be 2-D with unit column stride, out uint8 [{slots}, >= {nbytes}] on "
            f"{rows.device} with unit column stride, one stream per row of out"
        )
    triton = _resolve(backend, rows.device) == "triton"
    if isinstance(step, torch.Tensor):
        _check_device_step(step, rows.device, triton and spec.nonfinite is NonFinite.PROPAGATE)
        _check_rng(seed, 0, 0)
    else:
        _check_rng(seed, step, 0)
    _check_streams(tuple(streams))
    if triton and spec.nonfinite is NonFinite.PROPAGATE:
        table = on_device(tuple(streams), dtype=torch.int64, device=rows.device)
        _launch().encode_rows(
            rows,
            spec=spec,
            out=out,
            skip=k if skip is None else skip,
            streams=table,
            seed=seed,
            step=step,
        )
        return
    peers = [j for j in range(k) if j != skip]
    for s, (j, stream) in enumerate(zip(peers, streams, strict=True)):
        _encode(
            rows[j],
            None,
            spec,
            seed=seed,
            step=step,
            stream=stream,
            out=out[s, :nbytes],
            backend=backend,
        )


def _payload_out(out: torch.Tensor | None, numel: int, spec: QuantSpec, device) -> torch.Tensor:
    """A payload buffer for ``numel`` elements: ``out`` checked, or a new one."""
    nbytes = spec.payload_bytes(numel)
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes:
        raise ValueError(
            f"out must be 1-D uint8 of {nbytes} bytes for {numel} elements and {spec}; got "
            f"{out.dtype=} {tuple(out.shape)=}"
        )
    if not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be contiguous and on {device}")
    return out


def _stacked(payloads: torch.Tensor | list[Encoded], numel: int, spec: QuantSpec):
    if isinstance(payloads, (list, tuple)):
        for e in payloads:
            if e.spec != spec or e.numel != numel:
                raise ValueError("all Encoded inputs must share one spec and numel")
        payloads = torch.stack([e.payload for e in payloads])
    nbytes = spec.payload_bytes(numel)
    if payloads.dtype != torch.uint8 or payloads.dim() != 2 or payloads.shape[1] != nbytes:
        raise ValueError(
            f"payloads must be uint8 [k, {nbytes}] for numel={numel} and {spec}; got "
            f"{payloads.dtype=} {tuple(payloads.shape)=}"
        )
    if payloads.stride(1) != 1:
        payloads = payloads.contiguous()
    return payloads


def decode(
    enc: Encoded, *, out: torch.Tensor | None = None, backend: Backend = "auto"
) -> torch.Tensor:
    """Dequantize ``enc`` into a tensor of its original dtype and shape (or into ``out``)."""
    if not isinstance(enc, Encoded):
        raise TypeError(f"decode takes an Encoded, got {type(enc).__name__}")
    shape = enc.shape if enc.shape is not None else torch.Size([enc.numel])
    if out is None:
        out = torch.empty(shape, dtype=enc.dtype, device=enc.payload.device)
    _check_out(out, enc.numel, enc.payload.device)
    _decode_into(
        enc.payload.reshape(1, -1), enc.numel, enc.spec, out, accumulate=False, backend=backend
    )
    return out


def decode_add(enc: Encoded, target: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``target += decode(enc)`` in place, added in float32 and rounded once to target's dtype."""
    _check_float(target, "target")
    _check_out(target, enc.numel, enc.payload.device)
    _decode_into(
        enc.payload.reshape(1, -1), enc.numel, enc.spec, target, accumulate=True, backend=backend
    )
    return target


def decode_sum(
    payloads: torch.Tensor | list[Encoded],
    numel: int,
    spec: QuantSpec,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Float32 sum of ``k`` decoded chunks (stacked ``[k, payload_bytes]`` or Encoded list).

    Chunks are added in row order in float32, then inverse-rotated once. With
    ``accumulate=True`` the result is added onto ``out`` (e.g. a rank's own unquantized chunk).
    """
    p = _stacked(payloads, numel, spec)
    if out is None:
        if accumulate:
            raise ValueError("decode_sum(accumulate=True) needs out= to add onto")
        out = torch.empty(numel, dtype=torch.float32, device=p.device)
    _check_out(out, numel, p.device)
    _decode_into(p, numel, spec, out, accumulate=accumulate, backend=backend)
    return out


def decode_sum_finish(
    payloads: torch.Tensor,
    numel: int,
    spec: QuantSpec,
    *,
    base: torch.Tensor,
    out: torch.Tensor,
    divisor: int | None = None,
    runs: Sequence[tuple[int, int]] | None = None,
    backend: Backend = "auto",
) -> None:
    """A reduce-scatter's receive side in one launch on the Triton backend (two for several
    runs): ``base`` (the rank's own chunk) plus the sum of the decoded ``payloads`` in float32
    (as :func:`decode_sum` with ``accumulate=True``), divided by ``divisor``
    (:func:`divide_into`), written in ``out``'s dtype at the places ``runs`` name (``(start,
    length)`` of ``out``, in order, covering ``numel`` elements: a policy split's compressed
    runs; several are copied from a temporary in one ``_foreach_copy_``), or into
    ``out[:numel]``. Where the reference takes a float32 copy, a decode, a division, a cast
    and the copy.

    Args:
        payloads: uint8 ``[k, spec.payload_bytes(numel)]`` (rows may be strided).
        numel: elements of each payload.
        spec: the quantizer that made them.
        base: ``numel`` float values with unit stride (any float dtype), only read.
        out: a contiguous 1-D float tensor.
        divisor: divide by it (``op="avg"`` over that many ranks), or None.
        runs: where the ``numel`` values go, or None for ``out[:numel]`` in order.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
    """
    p = _stacked(payloads, numel, spec)
    _check_float(base, "base")
    _check_float(out, "out")
    places = runs if runs is not None else ((0, numel),)
    if _misfit(base, out, places, numel) or out.device != p.device:
        raise ValueError(
            f"decode_sum_finish: base {tuple(base.shape)} (strides {base.stride()}) on "
            f"{base.device}, out {tuple(out.shape)} on {out.device}, runs {runs}: base must "
            f"be {numel} elements with unit stride, out 1-D contiguous on {p.device}, the runs "
            f"(start, length) inside out, in order, not overlapping, covering {numel} elements"
        )
    if numel == 0:
        return
    if _resolve(backend, p.device) == "triton":
        # contiguous into out's one run (or a temporary the runs are copied from, one launch)
        (start, _), *more = places
        if not more:
            flat = out[start : start + numel]
        else:
            flat = torch.empty(numel, dtype=out.dtype, device=out.device)
        _launch().decode_sum_finish(p, numel=numel, spec=spec, base=base, out=flat, divisor=divisor)
        if more:
            _put_runs(out, flat, places)
        return
    acc = base.to(torch.float32, copy=True)
    _decode_into(p, numel, spec, acc, accumulate=True, backend="reference")
    if divisor is not None:
        divide_into(acc, acc, divisor)
    _put_runs(out, acc, places)


def _misfit(
    base: torch.Tensor, out: torch.Tensor, places: Sequence[tuple[int, int]], numel: int
) -> bool:
    """Whether a receive side's ``base`` (``numel`` values, unit stride), ``out`` (1-D,
    contiguous, on base's device) and ``places`` (``(start, length)`` inside ``out``, in order,
    not overlapping, covering ``numel``) do not fit together (each caller names its own
    arguments in the error)."""
    end = 0
    for s, n in places:
        if s < end or n < 0:
            return True
        end = s + n
    return bool(
        base.dim() != 1
        or base.numel() != numel
        or (numel and base.stride(0) != 1)
        or out.dim() != 1
        or not out.is_contiguous()
        or sum(n for _, n in places) != numel
        or end > out.numel()
        or base.device != out.device
    )


def _put_runs(out: torch.Tensor, values: torch.Tensor, places: Sequence[tuple[int, int]]) -> None:
    """Copy ``values`` (1-D, the runs' elements in order, any float dtype) to the ``places``
    of ``out`` (``(start, length)`` in order, not overlapping, as :func:`_misfit` checks): one
    cut of ``out`` at every run's ends and one ``_foreach_copy_`` (not a slice per run)."""
    sizes, picks, lengths = cut_runs(tuple(places), out.numel())
    pieces = out.split_with_sizes(sizes)
    torch._foreach_copy_([pieces[i] for i in picks], list(values.split_with_sizes(lengths)))


@functools.lru_cache(maxsize=1024)
def cut_runs(
    places: tuple[tuple[int, int], ...], total: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A cut of ``total`` elements at every run's start and end (``places``: ``(start,
    length)`` in order, not overlapping, ending within ``total``), which of the pieces are the
    runs, and the runs' lengths: ``split_with_sizes`` of the first, picked by the second,
    gives every run's view in one torch op (cached per layout)."""
    sizes, picks, at = [], [], 0
    for s, n in places:
        if s > at:
            sizes.append(s - at)
        picks.append(len(sizes))
        sizes.append(n)
        at = s + n
    if total > at:
        sizes.append(total - at)
    return tuple(sizes), tuple(picks), tuple(n for _, n in places)


def divide_into(out: torch.Tensor, acc: torch.Tensor, divisor: int) -> None:
    """``out = acc / divisor`` computed in float32 (``acc``'s dtype) by IEEE division and cast
    as it writes ``out``: the average of every qsdp reduction. (Divided by a device scalar,
    not a Python number: CUDA's ``torch.div`` multiplies by the reciprocal of a host scalar,
    which is not the division the kernels compute.)"""
    torch.div(acc, on_device(float(divisor), dtype=torch.float32, device=acc.device), out=out)


def decode_rows(
    payloads: torch.Tensor | list[Encoded],
    numel: int,
    spec: QuantSpec,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Decode ``k`` payloads (stacked ``[k, payload_bytes]``) into the ``k`` rows of ``out``.

    One launch for all rows (the all-gather's receive side): row ``j`` of ``out`` equals
    ``decode`` of payload ``j``. ``out`` defaults to float32 ``[k, numel]``; any float dtype and
    any row stride work (e.g. ``output.view(k, numel)``). ``accumulate=True``: row ``j`` of
    ``out`` gets ``decode`` of payload ``j`` added, in float32 and rounded once, the bits of
    :func:`decode_add` on each row (the weight-difference all-gather's ``k`` launches in one).
    """
    p = _stacked(payloads, numel, spec)
    k = p.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("decode_rows(accumulate=True) needs out= to add onto")
        out = torch.empty(k, numel, dtype=torch.float32, device=p.device)
    _check_float(out, "out")
    if out.dim() != 2 or tuple(out.shape) != (k, numel) or (numel and out.stride(1) != 1):
        raise ValueError(
            f"out must be [{k}, {numel}] with contiguous rows; got {tuple(out.shape)=} "
            f"{out.stride()=}"
        )
    if out.device != p.device:
        raise ValueError(f"out must be on {p.device}, got {out.device}")
    if k == 0 or numel == 0:
        return out
    if _resolve(backend, p.device) == "triton":
        _launch().decode(
            p, numel=numel, spec=spec, out=out, accumulate=accumulate, rotate=True, separate=True
        )
        return out
    for j in range(k):  # each row as decode (or decode_add) computes it
        _decode_into(p[j : j + 1], numel, spec, out[j], accumulate=accumulate, backend="reference")
    return out


def decode_sum_encode(
    payloads: torch.Tensor | list[Encoded],
    numel: int,
    in_spec: QuantSpec,
    out_spec: QuantSpec,
    *,
    seed: int = 0,
    step: int | torch.Tensor = 0,
    stream: int = 0,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> Encoded:
    """Decode ``k`` chunks, sum in float32 and re-encode with ``out_spec`` in one pass.

    All in the Hadamard domain: the result decodes (with the inverse rotation) to the sum. This is
    the middle hop of SDP4Bit's two-level reduce-scatter (8-bit intra-node in, 4-bit out).
    It never raises (no host sync on the hot path): an input group flagged NaN, or a summed group
    too large for ``out_spec``, is sent as a flagged (NaN) group whatever ``out_spec.nonfinite``.
    ``step`` may also be one int64 on the payloads' device, read by the Triton kernel when it
    runs (a launch a CUDA graph replays), as for :func:`encode`.
    """
    if in_spec.hadamard_block != out_spec.hadamard_block or (
        in_spec.hadamard_seed != out_spec.hadamard_seed
    ):
        raise ValueError(
            "decode_sum_encode keeps the Hadamard domain: in_spec and out_spec need the same "
            f"hadamard_block and hadamard_seed; got {in_spec} and {out_spec}"
        )
    if in_spec.group_size != out_spec.group_size:
        raise ValueError(
            f"decode_sum_encode needs one group size; got {in_spec.group_size} and "
            f"{out_spec.group_size}"
        )
    p = _stacked(payloads, numel, in_spec)
    triton = _resolve(backend, p.device) == "triton"
    if isinstance(step, torch.Tensor):  # (read by the kernel: a launch a CUDA graph replays)
        _check_device_step(step, p.device, triton, "decode_sum_encode")
        _check_rng(seed, 0, stream)
    else:
        _check_rng(seed, step, stream)
    out = _payload_out(out, numel, out_spec, p.device)
    if triton:
        _launch().decode_sum_encode(
            p,
            numel=numel,
            in_spec=in_spec,
            out_spec=out_spec,
            out=out,
            seed=seed,
            step=step,
            stream=stream,
        )
    else:
        out.copy_(
            ref.decode_sum_encode_flat(
                p, numel, in_spec, out_spec, seed=seed, step=step, stream=stream
            )
        )
    return Encoded(payload=out, numel=numel, dtype=dtype, spec=out_spec)


def _check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
    if out.numel() != numel or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"out must be a contiguous tensor of {numel} elements on {device}; got "
            f"{tuple(out.shape)=} contiguous={out.is_contiguous()} {out.device=}"
        )
    _check_float(out, "out")


def _decode_into(p, numel, spec, out, *, accumulate, backend) -> None:
    flat = out.reshape(-1)
    if _resolve(backend, p.device) == "triton":
        _launch().decode(p, numel=numel, spec=spec, out=flat, accumulate=accumulate, rotate=True)
        return
    vals = ref.decode_sum_flat(p, numel, spec)
    if accumulate:
        vals = flat.float() + vals
    flat.copy_(vals)
