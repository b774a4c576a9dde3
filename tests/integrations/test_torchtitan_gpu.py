"""GPU tier: torchtitan 0.3's own ``Trainer`` on its llama3 debug model, NCCL, qsdp selected on
the command line exactly as a user writes it (``--override.imports
'qsdp.integrations.torchtitan.compress={"recipe": ...}'``), against the same job without it:
FSDP2 on two GPUs, FSDP2 + TP (data-parallel 2, tensor-parallel 2) on four.

Run on a host with two or more GPUs: ``pytest -m gpu tests/integrations/test_torchtitan_gpu.py``.

torchtitan 0.3 needs torch>=2.12 (``torch.distributed.fsdp.DataParallelMeshDims``, imported by
``torchtitan/distributed/fsdp.py``); on an older torch the tests skip and say so. Where the
torch is new enough but torchtitan is missing and nothing can be fetched, carry its wheels
(Python 3.12, manylinux x86_64) and install them with ``pip install --no-deps``:
torchtitan-0.3.0, spmd_types-0.2.3, tyro-1.0.17, docstring_parser-0.18.0, typeguard-4.6.1,
torchdata-0.11.0, torch_checkpointing-0.1.1, datasets-4.1.1, dill-0.4.0, multiprocess-0.70.16
(what ``import torchtitan.trainer`` loads beyond a CUDA image that has pyarrow, pandas,
aiohttp, xxhash, tensorboard and einops; ``constraints.txt`` pins the rest of ``qsdp[torchtitan]``).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch
import torch.distributed.fsdp

from qsdp.testing import count_dist_bytes, run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs"),
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed: pip install 'qsdp[torchtitan]', or carry the "
        "wheels this file's docstring lists",
    ),
    pytest.mark.skipif(
        not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"),
        reason=f"torchtitan 0.3 needs torch>=2.12 (torch.distributed.fsdp.DataParallelMeshDims); "
        f"this is torch {torch.__version__}",
    ),
]

STEPS = 20
RECIPES = ("sdp4bit", "qsdp-w8g8")
TP = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="FSDP2 + TP 2 needs 4 GPUs")


def _command_line(out_dir: str, recipe: str | None, tp: int, graphs: bool = False) -> list[str]:
    """What a user types after ``torchrun ... -m torchtitan.train``."""
    args = ["--module", "tests.integrations.torchtitan_job", "--config", "qsdp_debugmodel"]
    args += ["--dump_folder", out_dir, "--parallelism.tensor_parallel_degree", str(tp)]
    if not graphs:
        args.append("--training.disable_cuda_graphs")
    if recipe is not None:
        args += [
            "--override.imports",
            f'qsdp.integrations.torchtitan.compress={{"recipe": "{recipe}"}}',
        ]
    return args


def _trainer(rank: int, world: int, args: list[str]):
    """``torchtitan.train.main`` up to ``train()``, in this process (the process group is
    run_distributed's; torchtitan's init_distributed keeps it)."""
    from torchtitan.config import ConfigManager

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    return ConfigManager().parse_args(args).build()


def _train(rank: int, world: int, recipe: str | None, tp: int, out_dir: str) -> dict:
    trainer = _trainer(rank, world, _command_line(out_dir, recipe, tp))
    try:
        with count_dist_bytes() as sent:
            trainer.train()
    finally:
        trainer.close()
    optimizers = trainer.optimizers
    return {
        "container": type(optimizers).__name__,
        "losses": trainer.metrics_processor.losses,
        "qsdp_bytes": optimizers.compressed.stats.total_bytes if recipe else None,
        "dist_bytes": sent.total_bytes,
    }


def _runs(rank: int, world: int, tp: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="qsdp-titan-") as out_dir:
        return {name: _train(rank, world, name, tp, out_dir) for name in (None, *RECIPES)}


def _check(runs: list[dict]) -> None:
    plain = runs[0][None]
    assert plain["container"] == "OptimizersContainer" and len(plain["losses"]) == STEPS
    for recipe in RECIPES:
        qsdp = runs[0][recipe]
        assert qsdp["container"] == "QSDPOptimizersContainer"
        assert len(qsdp["losses"]) == STEPS
        assert qsdp["losses"][0] == pytest.approx(plain["losses"][0], rel=0.01)
        assert qsdp["losses"][-1] < 0.8 * qsdp["losses"][0], qsdp["losses"]
        assert qsdp["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.02), (recipe, runs[0])
        assert 0 < qsdp["qsdp_bytes"] < 0.5 * plain["dist_bytes"], (recipe, runs[0])
        for other in runs[1:]:  # torchtitan's logged loss is global: every rank the same
            assert other[recipe]["losses"] == qsdp["losses"]
            assert other[recipe]["qsdp_bytes"] == qsdp["qsdp_bytes"]


def test_fsdp2_on_two_gpus_trains_like_the_uncompressed_run():
    _check(run_distributed(_runs, 2, 1, backend="nccl", timeout_s=900))


@TP
def test_fsdp2_with_tp_on_four_gpus_trains_like_the_uncompressed_run():
    _check(run_distributed(_runs, 4, 2, backend="nccl", timeout_s=900))


def _with_cuda_graphs(rank: int, world: int) -> str:
    with tempfile.TemporaryDirectory(prefix="qsdp-titan-") as out_dir:
        trainer = _trainer(rank, world, _command_line(out_dir, RECIPES[0], 1, graphs=True))
        try:
            trainer.train()
        except Exception as e:  # the capture's own error may wrap qsdp's
            chain = []
            while e is not None:
                chain.append(str(e))
                e = e.__cause__ or e.__context__
            return "\n".join(chain)
        return "trained"


def test_cuda_graphs_are_refused_on_every_rank():
    messages = run_distributed(_with_cuda_graphs, 2, backend="nccl", timeout_s=600)
    for message in messages:
        assert "--training.disable_cuda_graphs" in message, message
