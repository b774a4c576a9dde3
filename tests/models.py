"""The small classifier the DDP, HSDP and staleness tests train on gloo.

Four tokens in, the class ``7 * sum(tokens) mod 64`` out: learnable in a few dozen steps, with 1-D
parameters (biases, LayerNorm) that the default policy sends raw beside the quantized matrices."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import qsdp

D = 48
VOCAB = 64


def classifier() -> nn.Sequential:
    """The model, the same weights on every call and rank."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, D),
        nn.Flatten(),
        nn.Linear(4 * D, D),
        nn.GELU(),
        nn.LayerNorm(D),
        nn.Linear(D, VOCAB),
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (16 examples)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (16, 4), generator=g)
    return x, (x.sum(1) * 7) % VOCAB


def sharded_classifier(mesh=None) -> nn.Module:
    """:func:`classifier` with its two linear layers and the root ``fully_shard``-ed over
    ``mesh`` (default: the world)."""
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(
    model: nn.Module, rank: int, steps: int, *, group: dist.ProcessGroup | None = None
) -> list[float]:
    """AdamW on :func:`batch` (rank ``rank``'s) for ``steps`` steps; the loss of each step,
    averaged over the ranks of ``group`` (default: the world)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / dist.get_world_size(group))
    return losses


def train_delayed_by_hand(model: nn.Module, opt, backward, steps: int) -> None:
    """The staleness-1 schedule done by hand around a synchronous model: step ``t`` applies the
    gradient the backward of step ``t - 1`` left in ``.grad`` (zeros at ``t = 0``), and one more
    step applies the last one. ``backward(step)`` runs the forward and backward of a step."""
    previous = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(steps + 1):
        if step < steps:
            backward(step)
        current = [p.grad.clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), previous, strict=True):
            p.grad.copy_(g)
        opt.step()
        opt.zero_grad(set_to_none=False)
        previous = current


GATED_STEPS = 5


def train_gated(model: nn.Module, opt, state, backward) -> list[bool]:
    """Staleness 1 with a gate that fires at every step applying a delayed gradient: drain and
    apply the reduction in flight, run the next step synchronously, skip the steps that apply
    nothing. Returns which steps the gate fired at."""
    gate = qsdp.StalenessGate(1e-12)
    fired, sync_next = [], False
    for step in range(GATED_STEPS):
        sync, sync_next = sync_next, False
        with state.synchronous() if sync else contextlib.nullcontext():
            backward(step)
        fired.append(False)
        if state.applied_nothing:
            opt.zero_grad(set_to_none=False)
            continue
        opt.step()
        opt.zero_grad(set_to_none=False)
        if not sync and gate.check(grad_norm=1.0, lr=1.0):
            state.drain()
            opt.step()
            opt.zero_grad(set_to_none=False)
            fired[-1] = sync_next = True
    return fired


def train_gated_by_hand(model: nn.Module, opt, backward) -> None:
    """What :func:`train_gated` must do, around a synchronous model: the gradients of steps
    0 and 1 applied at step 1, step 2's at once, 3's and 4's at step 4."""
    kept = []
    for step, apply in enumerate([[], [0, 1], [2], [], [3, 4]]):
        backward(step)
        kept.append([p.grad.clone() for p in model.parameters()])
        for i in apply:
            for p, g in zip(model.parameters(), kept[i], strict=True):
                p.grad.copy_(g)
            opt.step()
        opt.zero_grad(set_to_none=False)


@contextlib.contextmanager
def dist_calls(name: str) -> Iterator[list[dict]]:
    """Record every call of ``torch.distributed.<name>`` made inside the block: its arguments
    by name, defaults filled in."""
    real = getattr(dist, name)
    signature = inspect.signature(real)
    calls: list[dict] = []

    def recorded(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return real(*args, **kwargs)

    setattr(dist, name, recorded)
    try:
        yield calls
    finally:
        setattr(dist, name, real)


@contextlib.contextmanager
def flag_groups() -> Iterator[list]:
    """Record the process group of every int32 MAX all-reduce (qsdp's NaN/Inf flags) made
    inside the block (filled when it ends, an exception or not): [Note: one flag agreement per
    backward]."""
    seen: list = []
    with dist_calls("all_reduce") as calls:
        try:
            yield seen
        finally:
            seen += [
                c["group"]
                for c in calls
                if c["tensor"].dtype == torch.int32 and c["op"] == dist.ReduceOp.MAX
            ]


def nan_gradient(module: nn.Module):
    """From the next forward on, ``module.weight``'s gradient turns NaN (the hook goes on the
    weight each forward sees: under FSDP2 the unsharded one); ``.remove()`` the returned
    handle to stop it."""

    def poison(mod: nn.Module, args: object) -> None:
        mod.weight.register_hook(lambda g: g * float("nan"))

    return module.register_forward_pre_hook(poison)
