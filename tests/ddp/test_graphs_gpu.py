"""DDP with ``Schedule(graphs=True)`` trains bit for bit as the eager hook does ([Note: two
phases replayed] in ``qsdp.comm._two_phase``). Two or more GPUs: NCCL, a rank per GPU; one
GPU: three gloo processes share it (gloo moves the CUDA tensors through the host)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.testing import run_distributed

from .test_gpu import small_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

D = 96  # (buckets whose lengths do not divide by 3: phase 1's padding and split pieces)


def _run(rank: int, world: int, recipe: str, nan_at: int | None = None, **schedule) -> tuple:
    """Five steps of a small model in DDP (buckets of 64 KiB: several, of several shapes) with
    ``recipe``'s hook: the losses and ``.zeroed``, the weights, the bytes, the last two steps'
    calls, captures and replays, and the hook's graphs."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    model = small_model(D, dev)
    ids = [dev.index] if dist.get_backend() == "nccl" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=1 / 16)
    config = qsdp.recipe(recipe, nonfinite="zero") if nan_at is not None else recipe
    state = qsdp.ddp.register(ddp, config, schedule=qsdp.Schedule(**schedule))
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    losses = []
    for step in range(5):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 512, (32, 4), generator=g).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(ddp(x).float(), x[:, 0])
        if step == nan_at and rank == 0:  # every bucket NaN on one rank: zeroed everywhere
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step == 0:  # (the first backward runs eagerly: DDP rebuilds its buckets after it)
            assert state.graphs is None or state.graphs.captured == 0
        if step == 2:  # from here on every segment is replayed
            mark = (state.stats["two_phase_all_reduce"].calls, *_counts(state.graphs))
    # the last two steps: their calls, and the segments captured and replayed in them
    late = (state.stats["two_phase_all_reduce"].calls - mark[0],) + tuple(
        a - b for a, b in zip(_counts(state.graphs), mark[1:], strict=True)
    )
    weights = torch.cat([p.detach().float().reshape(-1) for p in ddp.parameters()])
    if nan_at is not None:
        assert state.zeroed > 0 and torch.isfinite(weights).all(), state.zeroed
    losses.append(state.zeroed)
    return losses, weights.cpu(), state.stats.snapshot(), late, state.graphs


def _counts(graphs) -> tuple[int, int]:
    return (0, 0) if graphs is None else (graphs.captured, graphs.replayed)


def _replayed_vs_eager(
    rank: int, world: int, recipe: str, pipeline: bool, nan_at: int | None
) -> tuple[int, ...]:
    """The eager and the replayed run the same bits; returns the replayed run's replays, its
    last two steps' calls, captures and replays, and its call sites."""
    eager = _run(rank, world, recipe, nan_at, pipeline=pipeline)
    replayed = _run(rank, world, recipe, nan_at, pipeline=pipeline, graphs=True)
    # the losses (a NaN one included: compared as text) and .zeroed
    assert list(map(repr, eager[0])) == list(map(repr, replayed[0])), (eager[0], replayed[0])
    assert torch.equal(eager[1], replayed[1])
    assert eager[2] == replayed[2]  # the same bytes, under the same names
    assert eager[3][1:] == (0, 0) and eager[3][0] == replayed[3][0]
    assert replayed[0][-2] < replayed[0][0], replayed[0]
    graphs = replayed[4]
    buckets = sum(1 for key in graphs.sites if key[0][0] == "two_phase_all_reduce")
    return graphs.replayed, *replayed[3], buckets


@pytest.mark.parametrize(
    ("recipe", "pipeline", "nan_at"),
    [("cgx", False, None), ("qsdp-g8", True, None), ("cgx", False, 2)],
)
def test_replayed_two_phases_train_bit_for_bit(recipe, pipeline, nan_at):
    """The replayed hook trains the eager hook's bits, its NaN/Inf check replayed too (a step
    whose gradients are NaN on one rank: every bucket zeroed and counted alike)."""
    many = torch.cuda.device_count() >= 2
    ws = min(torch.cuda.device_count(), 4) if many else 3
    backend = "nccl" if many else "gloo"
    got = run_distributed(
        _replayed_vs_eager, ws, recipe, pipeline, nan_at, backend=backend, timeout_s=600
    )
    # several buckets, the first step's eager (DDP rebuilds them after it); in the last two
    # steps nothing is captured and each call replays four segments (phase 1's encode, its
    # decode and phase 2's encode as one, phase 2's decode, then the NaN/Inf check).
    # (Pipelined, a bucket's stream alternates from step to step with an odd number of
    # buckets: a site per stream, all captured by step 2 on one H200.)
    replayed, calls, captured_late, replayed_late, buckets = got[0]
    assert buckets >= 2 and calls >= 2 * 2 and all(g == got[0] for g in got), got
    assert captured_late == 0 and replayed_late == 4 * calls and replayed >= replayed_late, got
