"""qsdp's own CUDA streams are never the pooled low-priority streams that NCCL communicators
and CUDA futures' callbacks take ([Note: side streams from the high-priority pool])."""

from __future__ import annotations

import pytest
import torch

from qsdp.runtime import side_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def test_side_streams_are_never_low_priority_pool_streams():
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = [torch.cuda.Stream(dev).cuda_stream for _ in range(32)]
    # the pool is round-robin over 32: the 33rd stream taken is the first again
    assert torch.cuda.Stream(dev).cuda_stream == pool[0]
    mine = [side_stream(dev) for _ in range(40)]  # more than a pool's worth: it wraps too
    assert not {s.cuda_stream for s in mine} & set(pool)
    assert all(s.priority < 0 for s in mine)  # higher than the default 0
    # and a callback of a CUDA future takes from the low-priority pool (why the hooks chain
    # none): the stream a callback runs on is one of the 32
    fut = torch.futures.Future(devices=[dev])
    fut.set_result(torch.zeros(1, device=dev))
    seen = fut.then(lambda _: torch.cuda.current_stream(dev).cuda_stream).wait()
    assert seen in pool
