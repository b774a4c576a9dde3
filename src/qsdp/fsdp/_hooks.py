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
returns (on CUDA the work is enqueued on the current stream, FSDP's reduce-scatter stream). These
two documented hooks are all qsdp installs; the one internal it reads (the group's parameter
layout, for policies, NaN reports and the quantized master) is described in ``api._layout``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .. import comm as qc

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# what a failed collective says on gloo and NCCL (torch's DistError subclasses aside)
_WIRE_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket")


class _Context:
    """Re-raise a ``torch.distributed`` failure (a peer gone, a timeout) with what qsdp was
    doing: which collective of which FSDP module. Any other error (out of memory, a CUDA
    launch failure, a bug) propagates as it is, its type kept, with a note naming the module."""

    def __init__(self, what: str, module: str) -> None:
        self.what, self.module = what, module
        self._scope: torch.profiler.record_function | None = None

    def __enter__(self) -> None:
        # under torch.profiler the hook's host time shows as one scope, as FSDP2's own do
        # (``qsdp::reduce-scatter (blocks.3)``); nothing is made when no profiler runs
        if torch.autograd._profiler_enabled():
            self._scope = torch.profiler.record_function(
                f"qsdp::{self.what} ({self.module or '<root>'})"
            )
            self._scope.__enter__()
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if self._scope is not None:
            self._scope.__exit__(kind, err, tb)
        if kind is None or str(err).startswith("qsdp"):
            return False
        where = f"qsdp {self.what} of FSDP module '{self.module or '<root>'}'"
        if _from_the_wire(err):
            raise RuntimeError(
                f"{where} failed in torch.distributed (a peer rank died, hung past the process "
                f"group's timeout, or the network failed): {err}"
            ) from err
        if hasattr(err, "add_note"):  # Python >= 3.11
            err.add_note(f"(raised inside {where})")
        return False


def _from_the_wire(err: BaseException) -> bool:
    """Whether ``err`` is a failed collective (not out of memory, not a kernel's error)."""
    if isinstance(err, torch.OutOfMemoryError):
        return False
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(w in text for w in _WIRE_WORDS)


def _usable(split: qc.Split | None, chunk: int, stats: qc.CommStats) -> qc.Split | None:
    """``split`` if it fits a chunk of ``chunk`` elements; else None, counted as
    ``policy_skipped`` (FSDP handed over another chunk, e.g. parameters without gradients)."""
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


class _Hook:
    """What every qsdp FSDP2 hook shares: plain allocation and an error context."""

    module_name = ""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _Gather(_Hook, AllGather):
    """An FSDP2 all-gather: ``__call__`` checks the dtype and runs ``_call`` in context.

    Every qsdp gather completes before it returns: FSDP2 waits only on c10d ``Work`` objects,
    so a returned qsdp handle would never be waited for. On CUDA "complete" means enqueued on
    FSDP's all-gather stream, which keeps the overlap with compute.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        _check_gather_dtype(input_tensor)
        with _Context("all-gather", self.module_name):
            self._call(output_tensor, input_tensor, group)

    def _call(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        raise NotImplementedError
