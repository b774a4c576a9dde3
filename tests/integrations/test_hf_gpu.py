"""GPU tier: the ``transformers`` Trainer with FSDP2 (Accelerate's plugin, ``fsdp_version=2``)
on two GPUs and NCCL, as a user launches it (no CPU labelling), qsdp added by
``qsdp.integrations.hf.compress_trainer``, against the same run without it.

Run on a host with two or more GPUs: ``pytest -m gpu tests/integrations/test_hf_gpu.py``."""

from __future__ import annotations

import tempfile

import pytest
import torch

from qsdp.testing import run_distributed

from .test_hf import BATCH, _launch_env, _same_outcome, dataset, tiny_llama, trainer_options

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs"),
]

STEPS = 20
RECIPES = ("qsdp-w8g8", "sdp4bit")


def _train(rank: int, world: int, recipe: str | None, out_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from qsdp.integrations import hf

    options = trainer_options(out_dir, STEPS)
    options.update(ddp_backend="nccl", bf16=True, fsdp=True, fsdp_config={"version": 2})
    args = TrainingArguments(**options)
    model = tiny_llama(hidden=256)
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(world * BATCH * STEPS, noise=0.3)
    )
    callback = hf.compress_trainer(trainer, recipe) if recipe else None
    trainer.train()
    assert trainer.accelerator.distributed_type.value == "FSDP"
    compressed = callback.compressed if callback else None
    return {
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "qsdp_bytes": compressed.stats.total_bytes if compressed else None,
        "device": str(next(trainer.model.parameters()).device.type),
        "checksum": _same_outcome(trainer.model_wrapped),
    }


def _runs(rank: int, world: int, out_dir: str) -> dict:
    _launch_env(rank, world)
    return {name: _train(rank, world, name, out_dir) for name in (None, *RECIPES)}


def test_trainer_fsdp2_on_nccl_trains_like_the_uncompressed_run():
    with tempfile.TemporaryDirectory(prefix="qsdp-hf-gpu-") as out_dir:
        results = run_distributed(_runs, 2, out_dir, backend="nccl", timeout_s=600)
    plain = results[0][None]
    assert plain["device"] == "cuda"
    for name in RECIPES:
        run = results[0][name]
        assert len(run["losses"]) == STEPS
        assert run["losses"][-1] < 0.9 * run["losses"][0], (name, run["losses"])
        assert run["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.02), (name, plain, run)
        assert run["qsdp_bytes"] > 0, name
    for r in results[1:]:
        assert r == results[0]  # every rank: the same losses, outputs and bytes
