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
from ._stats import CommStats

__all__ = ["all_gather", "all_gather_wire_bytes"]

_NAME = "all_gather"


def all_gather_wire_bytes(shard_numel: int, spec: QuantSpec) -> int:
    """Bytes one rank hands to ``torch.distributed`` in :func:`all_gather` of a shard.

    Args:
        shard_numel: elements of each rank's input.
        spec: the quantizer.

    Returns:
        ``spec.payload_bytes(shard_numel)`` (the uncompressed all-gather sends
        ``shard_numel * element_size``).
    """
    return spec.payload_bytes(shard_numel)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    spec: QuantSpec,
    async_op: bool = False,
    seed: int = 0,
    step: int = 0,
    bucket: int = 0,
    backend: Backend = "auto",
    stats: CommStats | None = None,
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
        async_op: return a :class:`CommWork` whose ``wait()`` finishes the gather and decodes.
        seed, step: key of the stochastic-rounding noise (the step counter of the training loop);
            the same on every rank, so runs are reproducible. Each rank's noise stream is
            derived from its global rank and ``bucket``.
        bucket: separates buffers gathered in the same step (e.g. FSDP parameter groups).
        backend: the quantizer backend (``"auto"``: Triton on CUDA, reference on CPU).
        stats: the byte counter to record into (default :data:`qsdp.comm.comm_stats`).

    Returns:
        A :class:`CommWork` when ``async_op``, else None.
    """
    stages = _all_gather_stages(
        output,
        input,
        group,
        spec=spec,
        seed=seed,
        step=step,
        bucket=bucket,
        hop=0,
        backend=backend,
        stats=C.resolve_stats(stats),
        name=_NAME,
    )
    return C.run_stages(stages, async_op)


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
    count_call: bool = True,
) -> C.Stages:
    """Validate and encode now (not on the first ``next``), and return the stage generator."""
    C.check_spec(spec)
    C.check_float(input, "input")
    C.check_float(output, "output")
    C.check_contiguous(output, "output")
    C.check_same_device(output, input, "output and input")
    C.check_key(seed, step, bucket)
    pg, n, _ = C.group_info(group)
    m = input.numel()
    if output.numel() != n * m:
        raise ValueError(
            f"output has {output.numel()} elements; all_gather of {m} elements over {n} ranks "
            f"needs world_size * input.numel() = {n * m}"
        )
    if count_call:
        stats.count_call(name)
    nbytes = spec.payload_bytes(m)
    send = torch.empty(nbytes, dtype=torch.uint8, device=input.device)
    enc_spec = C.encoding_spec(spec)
    encode(
        input,
        enc_spec,
        seed=seed,
        step=step,
        out=send,
        backend=backend,
        stream=C.noise_stream(dist.get_rank(), 0, bucket=bucket, hop=hop),
    )
    if enc_spec is not spec:  # every rank agrees before anything is exchanged
        C.agree_finite(flagged_groups(send, m, spec), [pg], stats, name)
    return _gather_decode(output, send, pg, n, m, spec, backend, stats, name)


def _gather_decode(output, send, pg, n, m, spec, backend, stats, name) -> C.Stages:
    if m == 0:
        return
    nbytes = send.numel()
    recv = torch.empty(n * nbytes, dtype=torch.uint8, device=send.device)
    yield [C.all_gather(recv, send, pg, stats, name)], True
    decode_rows(recv.view(n, nbytes), m, spec, out=output.view(n, m), backend=backend)
