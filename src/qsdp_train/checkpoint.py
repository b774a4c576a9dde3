"""``qsdp train``'s checkpoints: ``torch.distributed.checkpoint`` of the model, the optimizer,
qsdp's collective state (noise counters, reductions in flight, adaptive widths), staleness 1's
weight prediction and the trainer's own (step, staleness gate); the ``latest`` marker is written
last, and only then are older checkpoints pruned (all but the newest ``keep``, never the one
``latest`` names)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from qsdp.runtime import WeightPrediction, check_replicas

from .parallel import Parallel

__all__ = ["load_checkpoint", "save_checkpoint"]


def _checkpoint_state(
    par: Parallel,
    opt: torch.optim.Optimizer,
    step: int,
    gate: tuple[int, int] = (0, 0),
    predict: WeightPrediction | None = None,
) -> dict:
    msd, osd = get_state_dict(par.model, opt)
    state = {
        "model": msd,
        "optim": osd,
        "qsdp": par.state,  # its state_dict() reads the last backward's NaN/Inf verdict first
        # the staleness gate: synchronous steps forced so far, whether the next one is
        "trainer": {"step": torch.tensor(step), "gate": torch.tensor(gate)},
    }
    if predict is not None:  # staleness 1's last update, which the next step computes ahead by
        state["predict"] = predict
    return state


def save_checkpoint(
    out: Path,
    par: Parallel,
    opt: torch.optim.Optimizer,
    step: int,
    gate: tuple[int, int] = (0, 0),
    *,
    predict: WeightPrediction | None = None,
    keep: int = 0,
) -> Path:
    """Save the run's state as ``OUT/ckpt/step_NNNNNNN`` on every rank, then mark it ``latest``.

    Args:
        out: the run directory.
        par: the model as built (its qsdp state is saved too).
        opt: the optimizer.
        step: the steps completed.
        gate: the staleness gate's (forced steps, whether the next step is synchronous).
        predict: staleness 1's weight prediction, if any.
        keep: once the new checkpoint is complete on every rank and marked, delete all but the
            newest ``keep`` checkpoints (0 keeps all); the one ``latest`` names is never deleted.

    Returns:
        The checkpoint's directory.
    """
    path = out / "ckpt" / f"step_{step:07d}"
    if par.replicated:  # a save keeps one replica's copy: the others must hold the same bits
        check_replicas(
            par.model, par.replica_group, where=f"at step {step}; the checkpoint was not written"
        )
    dcp.save(_checkpoint_state(par, opt, step, gate, predict), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:  # the marker goes last: a half-written checkpoint is never loaded
        tmp = out / "ckpt" / "latest.tmp"
        tmp.write_text(path.name)
        tmp.replace(out / "ckpt" / "latest")
        if keep:
            _prune(out / "ckpt", keep=keep, latest=path.name)
    dist.barrier()
    return path


def _prune(ckpt: Path, *, keep: int, latest: str) -> None:
    # rank 0, after every rank's part of `latest` is on disk (the barrier before its marker)
    steps = sorted(p for p in ckpt.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        if old.name != latest:
            shutil.rmtree(old)


def load_checkpoint(
    out: Path,
    par: Parallel,
    opt: torch.optim.Optimizer,
    *,
    predict: WeightPrediction | None = None,
    comm_state: bool = True,
) -> tuple[int, tuple[int, int]]:
    """Load the run's last checkpoint; returns its step and the staleness gate's state (steps
    it forced to synchronise, whether the next step runs synchronously). ``comm_state=False``
    leaves qsdp's collective state as built (a recipe other than the checkpoint's)."""
    marker = out / "ckpt" / "latest"
    if not marker.is_file():
        raise FileNotFoundError(
            f"--resume: no finished checkpoint in {out / 'ckpt'} (the file 'latest' is written "
            "after a save completes); run without --resume to start afresh"
        )
    path = out / "ckpt" / marker.read_text().strip()
    state = _checkpoint_state(par, opt, 0, predict=predict)
    if not comm_state:
        del state["qsdp"]
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(par.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fired, sync_next = state["trainer"]["gate"].tolist()
    return int(state["trainer"]["step"]), (fired, sync_next)
