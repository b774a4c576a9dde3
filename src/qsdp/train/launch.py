"""Start ``qsdp train``'s processes: under ``torchrun`` join its group (NCCL on GPUs, gloo on
CPUs); run plainly, start ``nproc`` local gloo processes on this CPU machine. The transport is
``torch.distributed``'s own; nothing else is launched."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .data import open_data, prepare_data
from .trainer import TrainConfig, train_rank

__all__ = ["launch", "under_torchrun"]


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def launch(cfg: TrainConfig, *, nproc: int = 2) -> dict:
    """Train ``cfg``; returns rank 0's last metrics (``{}`` on other torchrun ranks)."""
    if under_torchrun():
        return _torchrun(cfg)
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    path = prepare_data(cfg.data, cfg.tokenizer)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    # rendezvous through a file, not a TCP store owned by rank 0: no rank's exit can pull the
    # store from under a peer that is still shutting down
    with tempfile.TemporaryDirectory(prefix="qsdp-train-") as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        procs = [
            ctx.Process(target=_local_worker, args=(r, nproc, store, cfg, str(path), results))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if failed:
        raise RuntimeError(f"qsdp train: ranks exited with codes {failed} (see their errors above)")
    return results.get()


def _local_worker(rank: int, world: int, store: str, cfg: TrainConfig, path: str, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        last = train_rank(cfg, open_data(Path(path)), torch.device("cpu"))
        if rank == 0:
            results.put(last)
        dist.barrier()  # every rank is done before any leaves
    finally:
        dist.destroy_process_group()


def _torchrun(cfg: TrainConfig) -> dict:
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        # rank 0 prepares (downloads at most once); the others then find it in the cache
        path = prepare_data(cfg.data, cfg.tokenizer) if dist.get_rank() == 0 else None
        dist.barrier()
        if path is None:
            path = prepare_data(cfg.data, cfg.tokenizer)
        last = train_rank(cfg, open_data(path), device)
        return last if dist.get_rank() == 0 else {}
    finally:
        dist.destroy_process_group()
