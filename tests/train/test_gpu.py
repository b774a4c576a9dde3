"""GPU tier: ``qsdp train`` stops and resumes on NCCL (checkpoints of CUDA tensors: weights,
optimizer, noise counters, a staleness-1 reduction in flight, error-feedback residuals).

The CPU tier checks resume bit for bit on gloo (``test_trainer.py``). GPU runs are not bit for
bit reproducible (atomics in the backward), so here a resumed run must follow the straight one
to within what that noise moves a loss, and its rows must not repeat or skip a step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from qsdp.testing import run_distributed
from qsdp_train.data import open_data, prepare_data
from qsdp_train.trainer import TrainConfig, train_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs"),
]

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 400
STEPS, STOP = 8, 4
#: (name, settings), on 2 GPUs: FSDP2 with weight differences (re-gathered in full after a
#: load), DDP with exact error feedback (each rank's residuals), FSDP2 and DDP at staleness 1 (the
#: reduction in flight and the last update, which the next step computes ahead by)
RUNS = (
    ("fsdp-sdp4bit", {"recipe": "sdp4bit"}),
    ("ddp-cgx-ef", {"recipe": "cgx", "parallel": "ddp", "error_feedback": True}),
    ("fsdp-sdp4bit-s1", {"recipe": "sdp4bit", "staleness": 1}),
    ("ddp-cgx-s1", {"recipe": "cgx", "parallel": "ddp", "staleness": 1}),
)


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        preset="cpu-tiny",
        steps=STEPS,
        micro_batch=4,
        block_size=64,
        eval_every=STEPS,
        eval_batches=2,
        warmup=1,
        seed=3,
        progress=False,
        tensorboard=False,
    )
    return TrainConfig(out=str(out), **(base | kw))


def _straight_and_resumed(rank: int, world: int, data: str, root: str) -> None:
    d, dev = open_data(Path(data)), torch.device("cuda", torch.cuda.current_device())
    for name, kw in RUNS:
        train_rank(_cfg(Path(root) / f"{name}-straight", **kw), d, dev)
        train_rank(_cfg(Path(root) / f"{name}-resumed", stop_at=STOP, **kw), d, dev)
        train_rank(_cfg(Path(root) / f"{name}-resumed", resume=True, **kw), d, dev)


def _losses(out: Path) -> tuple[list[int], list[float]]:
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]


def test_trainer_stops_and_resumes_on_nccl(tmp_path):
    data = prepare_data(_text(tmp_path), "byte", cache_dir=tmp_path / "cache")
    run_distributed(
        _straight_and_resumed, 2, str(data), str(tmp_path), backend="nccl", timeout_s=600
    )
    for name, _ in RUNS:
        steps_a, a = _losses(tmp_path / f"{name}-straight")
        steps_b, b = _losses(tmp_path / f"{name}-resumed")
        assert steps_a == steps_b == list(range(STEPS)), (name, steps_b)
        assert a[-1] < a[0] - 0.1, (name, a)  # it trains
        # up to the stop both runs are the same program; after it the resumed run restarts
        # from the checkpoint: a lost optimizer state or residual moves the loss by far more
        worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
        assert worst < 5e-3 * a[-1], (name, a, b)


def _text(tmp_path: Path) -> str:
    path = tmp_path / "play.txt"
    path.write_text(TEXT)
    return str(path)
