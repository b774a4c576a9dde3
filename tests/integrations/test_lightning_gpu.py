"""GPU tier: Lightning's Trainer on two GPUs and NCCL, ``DDPStrategy`` and
``ModelParallelStrategy`` (FSDP2), qsdp added by ``qsdp.integrations.lightning.QSDPCallback``,
against the same fit without it.

Run on a host with two or more GPUs: ``pytest -m gpu tests/integrations/test_lightning_gpu.py``."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from qsdp.testing import run_distributed

from .test_lightning import checksum, lit_module, strategy, trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs"),
]

STEPS = 20
HIDDEN = 256
RECIPES = {"ddp": ("cgx",), "fsdp2": ("qsdp-w8g8", "sdp4bit")}


def _fit(rank: int, world: int, kind: str, recipe: str | None, out_dir: str) -> dict:
    from qsdp.integrations.lightning import QSDPCallback

    callback = QSDPCallback(recipe) if recipe else None
    module = lit_module(fsdp=kind == "fsdp2", hidden=HIDDEN, samples=world * 4 * STEPS)
    callbacks = [callback] if callback else []
    run = trainer(
        rank, world, strategy(kind, world, "nccl"), callbacks, out_dir, gpu=True, steps=STEPS
    )
    run.fit(module)
    trained_on = module.losses[0].device.type
    if kind == "ddp":  # Lightning's DDP teardown moves the module to the CPU; NCCL compares on GPU
        module.cuda()
    losses = torch.stack(module.losses).cuda()
    dist.all_reduce(losses)
    compressed = callback.compressed if callback else None
    return {
        "losses": (losses / world).tolist(),
        "qsdp_bytes": compressed.stats.total_bytes if compressed else None,
        "device": trained_on,
        "checksum": checksum(module),
    }


def _runs(rank: int, world: int, out_dir: str) -> dict:
    return {
        (kind, name): _fit(rank, world, kind, name, out_dir)
        for kind, recipes in RECIPES.items()
        for name in (None, *recipes)
    }


def test_lightning_on_nccl_trains_like_the_uncompressed_run():
    with tempfile.TemporaryDirectory(prefix="qsdp-lightning-gpu-") as out_dir:
        results = run_distributed(_runs, 2, out_dir, backend="nccl", timeout_s=600)
    for kind, recipes in RECIPES.items():
        plain = results[0][kind, None]
        assert plain["device"] == "cuda"
        for name in recipes:
            run = results[0][kind, name]
            assert len(run["losses"]) == STEPS, (kind, name)
            assert run["losses"][-1] < 0.9 * run["losses"][0], (kind, name, run["losses"])
            assert run["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.02), (
                kind, name, plain, run,
            )  # fmt: skip
            assert run["qsdp_bytes"] > 0, (kind, name)
    for r in results[1:]:
        assert r == results[0]  # every rank: the same losses, outputs and bytes
