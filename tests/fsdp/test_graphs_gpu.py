"""``Schedule(graphs=True)`` trains bit for bit as the eager hooks do ([Note: codec segments
replayed] in ``qsdp.comm._graphs``). Two or more GPUs: NCCL, a rank per GPU; one GPU: three
gloo processes share it (gloo moves the CUDA tensors through the host)."""

from __future__ import annotations

import pytest
import torch

import qsdp
from qsdp.fsdp._state import _installed
from qsdp.testing import run_distributed

from .test_compress_fsdp import _batches
from .test_gpu import _build, _train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _replayed_vs_eager(rank: int, ws: int, recipe: str) -> tuple[list[float], int, list]:
    """Five steps of ``recipe`` (one level; ``NAME+mesh``: two, over a node mesh; ``+s1``: at
    staleness 1 from the first step, its delayed reductions replayed on their side streams,
    the estimates of its prediction too; ``+ahead``: the next step's weights gathered in the
    backward, on the gather's own stream) with and without ``Schedule(graphs=True)``: the same
    losses and weights; the losses, the segments the replayed run replayed and the
    collectives they belong to."""
    name, *options = recipe.split("+")
    mesh, stale, ahead = "mesh" in options, "s1" in options, "ahead" in options
    runs = {}
    for graphs in (False, True):
        model, dev = _build(
            name if mesh else None,  # (a recipe named here is built over a node mesh)
            ws,
            torch.bfloat16,
            config=qsdp.recipe(name),
            schedule=qsdp.Schedule(
                graphs=graphs, staleness=int(stale), start=0, gather_ahead=ahead
            ),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = _batches(rank, ws)
        losses = [float(_train_step(model, opt, dev, next(batches))) for _ in range(5)]
        weights = torch.cat([p.to_local().detach().float().reshape(-1) for p in model.parameters()])
        # (the two blocks replay; the root, embeddings and head of its own shapes, runs eagerly)
        assert qsdp.fsdp.comm_state(model).replayed == (("blocks.0", "blocks.1") if graphs else ())
        shared = {id(g): g for h in _installed(model).hooks if (g := getattr(h, "graphs", None))}
        sites = sorted({key[0][0] for g in shared.values() for key in g.sites})
        runs[graphs] = (losses, weights, sum(g.replayed for g in shared.values()), sites)
    assert runs[False][0] == runs[True][0], (runs[False][0], runs[True][0])
    assert torch.equal(runs[False][1], runs[True][1])
    assert runs[False][2] == 0
    return runs[True][0], runs[True][2], runs[True][3]


#: the collectives each recipe replays (sdp4bit: its reduce-scatter and its weight differences;
#: over a node mesh its two-level reduce-scatter, one level where the mesh has one)
REPLAYED = {
    "qsdp-w8g8": ["all_gather", "reduce_scatter"],
    "cgx": ["reduce_scatter"],
    "sdp4bit": ["all_gather_diff", "reduce_scatter"],
    "sdp4bit+mesh": ["all_gather_diff", "hierarchical_reduce_scatter"],
    "sdp4bit+s1": ["all_gather_diff", "reduce_scatter"],
    "sdp4bit+mesh+s1": ["all_gather_diff", "hierarchical_reduce_scatter"],
    "sdp4bit+s1+ahead": ["all_gather_diff", "reduce_scatter"],
}


@pytest.mark.parametrize("recipe", list(REPLAYED))
def test_replayed_codecs_train_bit_for_bit(recipe):
    many = torch.cuda.device_count() >= 2
    mesh = "+mesh" in recipe
    # (over a mesh: 2 nodes x 2 on four ranks, gloo processes sharing fewer GPUs)
    ws = 4 if mesh else min(torch.cuda.device_count(), 4) if many else 3
    backend = "nccl" if torch.cuda.device_count() >= ws else "gloo"
    got = run_distributed(_replayed_vs_eager, ws, recipe, backend=backend, timeout_s=600)
    # (each rank asserted its two runs the same bits; the losses are each rank's own batches)
    assert all(replayed > 0 and replayed == got[0][1] for _, replayed, _ in got), got
    assert all(sites == REPLAYED[recipe] for _, _, sites in got), got
    assert all(losses[-1] < losses[0] for losses, _, _ in got), got
