"""The CUDA streams qsdp runs communication work on, apart from those NCCL and futures take.

[Note: side streams from the high-priority pool]
``torch.cuda.Stream()`` hands out PyTorch's pooled streams round-robin: 32 low-priority streams
per device, the same 32 that every NCCL communicator's internal stream comes from (unless its
process group asks for a high-priority one) and that CUDA futures run their callbacks on. A
hook stream that is also a communicator's stream joins two queues that must stay apart: on 4x
H200 over sockets, DDP ``global-qsgd`` pipelined in 100 MiB buckets, the first hook stream was
the default communicator's stream, which carries the scales' MAX, so the last bucket's MAX
queued behind the third bucket's decode (on that hook stream), which waited for the third
bucket's SUM, and the wire idled between the last two SUMs while the MAX and the encode ran
(profiled; the sibling [Note: a CUDA future without a callback] in ``qsdp.comm._common`` is the
same collision with a callback's stream; with both, the codes' SUMs left the link idle 5.2 ms
of a 100 ms step, 0.5 ms after the fixes: ``benchmarks/results/session16_2026-11-27/``). So qsdp's
own streams come from the high-priority pool, as FSDP2's own streams do: no default
communicator or callback takes from it, and the small encode kernels queued there run ahead of
the backward's kernels when both are ready. The communicators qsdp makes for itself (the second
communicator of pipelined buckets, staleness 1's twins) ask NCCL for a high-priority internal
stream too (:func:`side_group`): a new communicator's stream is the pool's next one, wherever
the round-robin stands, and one run that profiled both exchanges of a bucket on a single stream
(the scales' MAX and the codes' SUM of ``global-qsgd``, whose overlap is the point of the second
communicator) had drawn the default communicator's stream again. Not yet: the twin 2-D mesh of
staleness 1's two-level reductions (``qsdp.fsdp._stale.twin_mesh``), which ``DeviceMesh`` builds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["side_group", "side_stream"]

HIGH_PRIORITY = -1
"""The stream priority of qsdp's own streams (FSDP2's ``high_priority``; lower is higher)."""


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream of ``device`` for qsdp's communication work (hook streams, delayed
    reductions), from the high-priority pool ([Note: side streams from the high-priority
    pool])."""
    return torch.cuda.Stream(device, priority=HIGH_PRIORITY)


def side_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``dist.new_group(ranks, **kwargs)`` for qsdp's own communication: on NCCL its internal
    stream comes from the high-priority pool, never the default communicator's stream
    ([Note: side streams from the high-priority pool]); other backends as they are."""
    if dist.get_backend() == "nccl" and "pg_options" not in kwargs:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        kwargs["pg_options"] = options
    return dist.new_group(ranks, **kwargs)
