"""A compressed model, its optimizer and everything qsdp installed go in the one garbage
collection that frees the model ([Note: the installation lives on the model] in
``qsdp/fsdp/_state.py``): while the installation was a weak dictionary's value, a compressed
model outlived its ``del model; gc.collect()`` until a later collection (the FSDP2 recipes' cases
failed on that code), and the next model of the process could be built beside it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import qsdp
from qsdp.testing import run_distributed

from ..models import classifier, train
from ..tiny_gpt import TinyGPT

VARIANTS = {  # name: (recipe, schedule): the NaN/Inf check's cycles, staleness 1's state
    "plain": (None, None),
    "sdp4bit": ("sdp4bit", None),
    "cgx": ("cgx", None),
    "sdp4bit+s1+ahead": ("sdp4bit", qsdp.Schedule(staleness=1, gather_ahead=True)),
}
DDP_VARIANTS = {"ddp cgx+s1": ("cgx", qsdp.Schedule(staleness=1))}


def _fsdp(recipe, schedule) -> tuple[list[weakref.ref], int]:
    """Train a few steps, drop the model and its optimizer; weak references to what must go."""
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if recipe is not None:
        qsdp.compress_fsdp(model, recipe, schedule=schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randint(0, 256, (4, 17), generator=g)
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    if schedule is not None:
        qsdp.fsdp.comm_state(model).drain()  # the last gradient, as a training loop ends
        opt.step()
    refs = [weakref.ref(model), weakref.ref(opt), *map(weakref.ref, model.parameters())]
    return refs, len(refs)


def _ddp(recipe, schedule) -> tuple[list[weakref.ref], int]:
    ddp = DDP(classifier(), bucket_cap_mb=0.01)
    state = qsdp.ddp.register(ddp, recipe, schedule=schedule)
    train(ddp, dist.get_rank(), 3)
    if schedule is not None:
        state.drain()
    refs = [weakref.ref(ddp), weakref.ref(state), *map(weakref.ref, ddp.parameters())]
    return refs, len(refs)


def _worker(rank: int, world: int) -> dict:
    alive = {}
    for name, (recipe, schedule) in VARIANTS.items():
        refs, n = _fsdp(recipe, schedule)
        gc.collect()  # once: the model's own cycles, and nothing left for a later one
        alive[name] = (sum(r() is not None for r in refs), n)
    for name, (recipe, schedule) in DDP_VARIANTS.items():
        refs, n = _ddp(recipe, schedule)
        gc.collect()
        alive[name] = (sum(r() is not None for r in refs), n)
    return alive


@pytest.fixture(scope="module")
def alive() -> list[dict]:
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("name", [*VARIANTS, *DDP_VARIANTS])
def test_one_collection_frees_the_model_on_every_rank(alive, name):
    for rank, seen in enumerate(alive):
        left, n = seen[name]
        assert n > 3, (name, n)  # the model, its optimizer or state, and parameters
        assert left == 0, f"rank {rank}, {name}: {left} of {n} objects alive after gc.collect()"
