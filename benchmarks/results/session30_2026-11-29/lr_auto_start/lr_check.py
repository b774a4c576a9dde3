"""The trainer's learning rate through staleness 1's automatic start, before and after 105b815.

    PYTHONPATH=<a checkout's src> python lr_check.py OUT_DIR

2 gloo processes, ``cpu-tiny``, ``sdp4bit``, 30 steps with a 25-step warm-up, no evaluation:
``sync`` (staleness 0) and ``auto`` (``--staleness 1``, the automatic start, the local
prediction); writes each run's ``metrics.csv`` under OUT_DIR and prints step, both rates and
both losses.
"""

import csv
import sys
from pathlib import Path

import torch

from qsdp.testing import run_distributed
from qsdp_train.data import open_data, prepare_data
from qsdp_train.trainer import TrainConfig, train_rank

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 400


def _runs(rank: int, world: int, data: str, root: str) -> None:
    d = open_data(Path(data))
    for name, kw in (("sync", {}), ("auto", {"staleness": 1})):
        cfg = TrainConfig(
            out=f"{root}/{name}", recipe="sdp4bit", preset="cpu-tiny", steps=30, micro_batch=2,
            block_size=32, eval_every=0, warmup=25, progress=False, tensorboard=False, **kw,
        )  # fmt: skip
        train_rank(cfg, d, torch.device("cpu"))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)
    (root / "play.txt").write_text(TEXT)
    data = prepare_data(str(root / "play.txt"), "byte", cache_dir=root / "cache")
    run_distributed(_runs, 2, str(data), str(root), timeout_s=600)
    rows = {n: list(csv.DictReader(open(root / n / "metrics.csv"))) for n in ("sync", "auto")}
    for a, b in zip(rows["sync"], rows["auto"], strict=True):
        print(a["step"], a["lr"], b["lr"], a["loss"], b["loss"], a["loss"] == b["loss"])
