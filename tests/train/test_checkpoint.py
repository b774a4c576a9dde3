"""``qsdp train``'s checkpoints: no checkpoint of replicas that differ ([Note: checking
replicas] in ``qsdp.runtime.replicas``)."""

from __future__ import annotations

from pathlib import Path

import torch

from qsdp.testing import run_distributed
from qsdp_train.checkpoint import save_checkpoint
from qsdp_train.model import ModelConfig
from qsdp_train.parallel import build


def _tiny(mode: str, recipe: str):
    """A one-block GPT on the CPU, parallelised as ``mode`` with ``recipe``."""
    mc = ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=32)
    return build(
        mode=mode,
        recipe_name=recipe,
        mc=mc,
        device=torch.device("cpu"),
        seed=0,
        bf16=False,
        two_level=False,
        nodes=None,
    )


def _save(rank: int, world: int, out: str) -> str | None:
    par = _tiny("ddp", "cgx")
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
    if rank == 1:  # a replica that drifted
        with torch.no_grad():
            next(par.model.parameters()).view(-1)[0] += 1.0
    try:
        save_checkpoint(Path(out), par, opt, 7)
    except RuntimeError as e:
        return str(e)
    return None


def test_qsdp_train_does_not_checkpoint_differing_replicas(tmp_path):
    for err in run_distributed(_save, 2, str(tmp_path)):
        assert err is not None and "replicas of the model differ at step 7" in err, err
        assert "the checkpoint was not written" in err
    assert not (tmp_path / "ckpt" / "step_0000007").exists()
    assert not (tmp_path / "ckpt" / "latest").exists()


def _save_five(rank: int, world: int, out: str) -> None:
    par = _tiny("fsdp", "bf16")
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
    for step in range(1, 6):
        save_checkpoint(Path(out), par, opt, step, keep=2)


def test_old_checkpoints_are_pruned_but_never_latest(tmp_path):
    # a half-written later checkpoint (a save that crashed after a resume from step 5's run)
    (tmp_path / "ckpt" / "step_0000009").mkdir(parents=True)
    run_distributed(_save_five, 2, str(tmp_path))
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    # the newest two names, and the one latest names though a newer name exists
    assert kept == ["latest", "step_0000005", "step_0000009"], kept
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_0000005"
