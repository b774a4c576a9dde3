"""qsdp in Lightning's own Trainer, with the real package on gloo: ``DDPStrategy`` and
``ModelParallelStrategy`` (FSDP2 through ``fully_shard`` in ``configure_model``), a tiny
language model, against the same fit without qsdp.

One spawn of two processes runs everything (importing Lightning costs seconds per process);
the tests below read its results. The workers are launched as ``torchrun`` launches them (RANK,
WORLD_SIZE, LOCAL_RANK set): Lightning then creates no processes and reuses the process group
``run_distributed`` made.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import qsdp
from qsdp.testing import assert_same_on_all_ranks, count_dist_bytes, run_distributed

from .checks import assert_bytes_counted_and_fewer

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 64, 32, 16, 4, 8
FSDP_RECIPE, DDP_RECIPE = "qsdp-w8g8", "cgx"


# --- model and data (shared with test_lightning_gpu.py) ---------------------------------------
class TinyLM(nn.Module):
    """Token embedding, residual MLP blocks, a head: next-token logits from the current
    token."""

    def __init__(self, hidden: int = HIDDEN, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(blocks)
        )
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def sequences(n: int, seed: int, noise: float = 0.3) -> torch.Tensor:
    """``n`` sequences in which each token is the previous one plus 3 (mod the vocabulary),
    ``noise`` of them drawn at random instead: a loss floor well above zero, so a relative
    bound at the end still means something."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    out = (start + 3 * torch.arange(SEQ)) % VOCAB
    random = torch.randint(0, VOCAB, out.shape, generator=g)
    return torch.where(torch.rand(out.shape, generator=g) < noise, random, out)


def lit_module(fsdp: bool, hidden: int = HIDDEN, samples: int = 2 * BATCH * STEPS):
    """A LightningModule training :class:`TinyLM` (the same weights on every rank); with
    ``fsdp`` its ``configure_model`` shards each block, then the model, on the data-parallel
    mesh (ModelParallelStrategy)."""
    import lightning.pytorch as pl
    from torch.distributed.fsdp import FSDPModule, fully_shard

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM(hidden)
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            if not fsdp or isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            # the same samples on every rank: Lightning's DistributedSampler splits them
            return torch.utils.data.DataLoader(list(sequences(samples, seed=7)), batch_size=BATCH)

    return LitLM()


def launch_env(rank: int, world: int) -> None:
    """What ``torchrun`` sets (Lightning's environment deletes WORLD_SIZE when a fit ends, so
    before every Trainer), and Lightning's chatter off."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")


def trainer(rank: int, world: int, strategy, callbacks, out_dir: str, *, gpu: bool = False,
            steps: int = STEPS, devices: int | None = None):  # fmt: skip
    """Lightning's Trainer on the ``world`` devices of this launch (or ``devices``), the bare
    minimum of output."""
    import lightning.pytorch as pl

    launch_env(rank, world)
    return pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=devices or world,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
    )


def strategy(kind: str, world: int, backend: str = "gloo"):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if kind == "ddp":
        return DDPStrategy(process_group_backend=backend)
    return ModelParallelStrategy(
        data_parallel_size=world, tensor_parallel_size=1, process_group_backend=backend
    )


def checksum(module) -> float:
    """Assert every rank computes the same logits on the same batch (under DDP: holds the same
    parameters too); returns the logits' sum, which the parent compares across ranks."""
    device = next(module.parameters()).device
    with torch.no_grad():
        logits = module.model(sequences(2, seed=99).to(device))
    assert_same_on_all_ranks(logits)
    for p in module.parameters():
        if not hasattr(p, "full_tensor"):  # DDP's replicas (FSDP2's shards differ by design)
            assert_same_on_all_ranks(p.detach())
    return float(logits.double().sum())


def fit(rank: int, world: int, kind: str, recipe: str | None, out_dir: str) -> dict:
    from qsdp.integrations.lightning import QSDPCallback

    callback = QSDPCallback(recipe) if recipe else None  # the added line
    module = lit_module(fsdp=kind == "fsdp2")
    run = trainer(rank, world, strategy(kind, world), [callback] if callback else [], out_dir)
    with count_dist_bytes() as sent:
        run.fit(module)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    compressed = callback.compressed if callback else None
    return {
        "compressed": type(compressed.model).__name__ if compressed else None,
        "losses": (losses / world).tolist(),
        "qsdp_bytes": compressed.stats.total_bytes if compressed else None,
        "dist_bytes": sent.total_bytes,
        "numel": sum(p.numel() for p in module.model.parameters()),
        "checksum": checksum(module),
    }


# --- misuse -----------------------------------------------------------------------------------
def _refusal(rank: int, world: int, out_dir: str, make_strategy, recipe: str, shard=None) -> str:
    """The ValueError a fit with QSDPCallback(recipe) raises; ``shard(model)``: what
    configure_model does (ModelParallelStrategy demands one)."""
    from qsdp.integrations.lightning import QSDPCallback

    devices = 1 if make_strategy is _one_device else world
    run = trainer(rank, world, make_strategy(), [QSDPCallback(recipe)], out_dir, devices=devices)
    module = lit_module(fsdp=False)
    if shard is not None:
        module.configure_model = lambda: shard(module.model)
    with pytest.raises(ValueError) as e:
        run.fit(module)
    return str(e.value)


def _one_device():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return SingleDeviceStrategy("cpu")


def _blocks_only(model: TinyLM) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)


def _misuse(rank: int, world: int, out_dir: str) -> dict:
    from lightning.pytorch.strategies import FSDPStrategy

    from qsdp.integrations.lightning import QSDPCallback

    out = {}
    with pytest.raises(ValueError) as e:
        QSDPCallback(DDP_RECIPE, schedule=qsdp.Schedule(staleness=1, start=0, predict="none"))
    out["stale"] = str(e.value)
    fsdp2, ddp = (lambda: strategy("fsdp2", world)), (lambda: strategy("ddp", world))
    # Lightning itself refuses FSDPStrategy without GPUs: the callback's check, as the Trainer
    # calls it when fitting begins (test_lightning_gpu.py fits it)
    callback, fit_with = QSDPCallback(FSDP_RECIPE), SimpleNamespace(strategy=FSDPStrategy())
    fit_with.world_size = world
    with pytest.raises(ValueError) as e:
        callback.setup(fit_with, lit_module(fsdp=False), "fit")
    out["fsdp1"] = str(e.value)
    out["one_device"] = _refusal(rank, world, out_dir, _one_device, DDP_RECIPE)
    out["no_fully_shard"] = _refusal(rank, world, out_dir, fsdp2, FSDP_RECIPE, lambda m: None)
    out["two_roots"] = _refusal(rank, world, out_dir, fsdp2, FSDP_RECIPE, _blocks_only)
    out["weights_under_ddp"] = _refusal(rank, world, out_dir, ddp, FSDP_RECIPE)
    return out


# --- one spawn, the tests read it --------------------------------------------------------------
def _everything(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    for kind, recipe in (("ddp", DDP_RECIPE), ("fsdp2", FSDP_RECIPE)):
        for name in (None, recipe):
            out[kind, name] = fit(rank, world, kind, name, out_dir)
    out["misuse"] = _misuse(rank, world, out_dir)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="qsdp-lightning-") as out_dir:
        return run_distributed(_everything, 2, out_dir, timeout_s=300)


CASES = [("ddp", DDP_RECIPE, "DistributedDataParallel"), ("fsdp2", FSDP_RECIPE, "FSDPTinyLM")]


@pytest.mark.parametrize("kind, recipe, compressed", CASES)
def test_trains_like_the_uncompressed_run(runs, kind, recipe, compressed):
    plain, qsdp = runs[0][kind, None], runs[0][kind, recipe]
    assert qsdp["compressed"] == compressed  # what the strategy built, found by the callback
    assert len(qsdp["losses"]) == len(plain["losses"]) == STEPS
    assert qsdp["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-3)
    assert qsdp["losses"][-1] < 0.9 * qsdp["losses"][0], qsdp["losses"]  # it learns
    # the compressed fit ends where the uncompressed one does (the recipes' 2% bound)
    assert qsdp["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.02), (plain, qsdp)
    assert qsdp["losses"] != plain["losses"]  # and what crossed the wire was compressed


@pytest.mark.parametrize("kind, recipe, compressed", CASES)
def test_bytes_are_counted_and_fewer(runs, kind, recipe, compressed):
    plain, qsdp = runs[0][kind, None], runs[0][kind, recipe]
    assert_bytes_counted_and_fewer(plain, qsdp, kind, STEPS)


@pytest.mark.parametrize("kind, recipe, compressed", CASES)
def test_every_rank_ends_the_same(runs, kind, recipe, compressed):
    for name in (None, recipe):
        first = runs[0][kind, name]
        for other in runs[1:]:
            assert other[kind, name]["losses"] == first["losses"]
            assert other[kind, name]["checksum"] == first["checksum"]
            assert other[kind, name]["qsdp_bytes"] == first["qsdp_bytes"]


def test_misuse_raises_naming_the_fix_on_every_rank(runs):
    for r in runs:
        message = r["misuse"]["stale"]
        assert "Schedule(staleness=1)" in message and "staleness=0" in message, message
        message = r["misuse"]["fsdp1"]
        assert "strategy=FSDPStrategy is FSDP1" in message, message
        assert "ModelParallelStrategy(" in message and "fully_shard" in message, message
        message = r["misuse"]["one_device"]
        assert "SingleDeviceStrategy: one device" in message, message
        message = r["misuse"]["no_fully_shard"]
        assert "holds no FSDP2 module" in message and "configure_model" in message, message
        message = r["misuse"]["two_roots"]
        assert "2 separate FSDP2 roots ['model.blocks.0', 'model.blocks.1']" in message, message
        message = r["misuse"]["weights_under_ddp"]  # qsdp.ddp.register's own check
        assert "compresses weights" in message and "'cgx'" in message, message
