"""qsdp selected in a torchtitan 0.3 job config (``--override.imports
'qsdp.integrations.torchtitan.compress={"recipe": ...}'``), with the real package on gloo: its
llama3 debug model under FSDP2 on two processes, against the same run without the override.

[Note: torchtitan on CPU]
torchtitan 0.3's ``Trainer`` and ``ParallelDims`` need an accelerator: without one,
``torchtitan.tools.utils`` takes ``"cuda"`` as the device type (``tools/utils.py``,
``get_device_info``), ``Trainer.__init__`` calls ``torch.cuda.set_device`` and
``ParallelDims.build_mesh`` builds every mesh on ``"cuda"``. So this CPU tier runs, with
torchtitan's own code, the part of ``Trainer.__init__`` the adapter lives in: the job's config
(``torchtitan_job.qsdp_debugmodel``, torchtitan's ``llama3_debugmodel`` on synthetic tokens),
``apply_overrides`` (which turns the override into qsdp's optimizer container), the debug model
built and initialised as the Trainer does, FSDP2 applied by ``apply_fsdp_to_decoder`` (what
``parallelize_llama`` calls, here over a CPU mesh, FSDP's gradient division off as torchtitan
sets it), the optimizer container built from the config, and torchtitan's loss scaling (the
sum over the global token count). Two CPU accommodations, each through a public interface:
FlexAttention has no backward on CPU, so the job adds an override of its own that makes it
causal SDPA (the same attention on these one-document sequences); gloo has no ``PREMUL_SUM``,
the op FSDP2 sends for torchtitan's division factor 1, so the uncompressed run asks FSDP2 for
the same sum as ``SUM``, as qsdp's container does. FSDP2 + TP needs ``ParallelDims``' meshes
and runs in ``test_torchtitan_gpu.py`` through the real ``Trainer``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch.distributed.fsdp import FSDPModule

pytest.importorskip("torchtitan", reason="needs torchtitan: pip install 'qsdp[torchtitan]'")
if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip(
        f"torchtitan 0.3 needs torch>=2.12 (torch.distributed.fsdp.DataParallelMeshDims); "
        f"this is torch {torch.__version__}",
        allow_module_level=True,
    )

import qsdp  # noqa: E402
from qsdp.testing import assert_same_on_all_ranks, count_dist_bytes, run_distributed  # noqa: E402

STEPS = 8
RECIPE = "sdp4bit"


def _config(recipe: str | None, **options):
    from torchtitan.config.override import apply_overrides

    from qsdp.integrations.torchtitan import TARGET

    from .torchtitan_job import CAUSAL_SDPA, qsdp_debugmodel

    config = qsdp_debugmodel()
    config.training.mixed_precision_param = "float32"  # CPU: no bf16 matmuls
    config.override.imports = [CAUSAL_SDPA]  # CPU: no FlexAttention backward
    if recipe is not None or options:
        config.override.imports.append((TARGET, {"recipe": recipe, **options}))
    config.model_spec.model.update_from_config(config=config)
    apply_overrides(config.override, config)  # as Trainer.__init__ does
    return config


def _model(config, mesh):
    """The debug model as Trainer.__init__ builds it, FSDP2 as parallelize_llama applies it."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    with torch.device("meta"):
        model = config.model_spec.model.build()
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # the same weights in both runs
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def _loss(model, inputs: dict, labels: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's scaling: this rank's summed cross-entropy over the global token count (FSDP2
    sums the gradients, its division off)."""
    logits = model(inputs["input"]).flatten(0, 1).float()
    return torch.nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum") / (
        global_tokens
    )


def _train(rank: int, world: int, recipe: str | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from .torchtitan_job import BATCH, SEQ, batch

    config = _config(recipe)
    model = _model(config, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    if recipe is None:  # gloo has no PREMUL_SUM ([Note: torchtitan on CPU])
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    optimizers = config.optimizer.build(model_parts=[model])  # qsdp compresses here
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(
        dp_world_size=world, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ,
        local_batch_size=BATCH,
    )  # fmt: skip
    data = iter(loader)
    losses = []
    with count_dist_bytes() as sent:
        for _ in range(STEPS):
            inputs, labels = next(data)
            loss = _loss(model, inputs, labels, world * labels.numel())
            loss.backward()
            optimizers.step()
            optimizers.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total))
    qsdp_bytes = optimizers.compressed.stats.total_bytes if recipe else None
    with torch.no_grad():
        inputs, labels = batch(2, seed=99)
        logits = model(inputs["input"])
    assert_same_on_all_ranks(logits)
    return {
        "container": type(optimizers).__name__,
        "losses": losses,
        "qsdp_bytes": qsdp_bytes,
        "dist_bytes": sent.total_bytes,
        "numel": sum(p.numel() for p in model.parameters()),
        "checksum": float(logits.double().sum()),
    }


def _raised(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def _misuse(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {
        "no recipe": _raised(_config, None, schedule={}),
        "unknown recipe": _raised(_config, "w3"),
        "stale": _raised(_config, RECIPE, schedule={"staleness": 1}),
        "schedule field": _raised(_config, RECIPE, schedule={"stalenes": 1}),
    }
    # torchtitan's HSDP / DDP: fully_shard on the 2-D (dp_replicate, fsdp) mesh
    config = _config(RECIPE)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "fsdp"))
    out["hsdp"] = _raised(lambda: config.optimizer.build(model_parts=[_model(config, mesh)]))
    return out


def _everything(rank: int, world: int) -> dict:
    out = {name: _train(rank, world, name) for name in (None, RECIPE)}
    out["misuse"] = _misuse(rank, world)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_everything, 2, timeout_s=300)


def test_the_command_line_selects_qsdp():
    """The flags a user adds to ``torchrun ... -m torchtitan.train``, parsed by torchtitan."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    from qsdp.integrations.torchtitan import QSDPOptimizersContainer

    selected = 'qsdp.integrations.torchtitan.compress={"recipe": "cgx", '
    selected += '"schedule": {"own_reduce_group": true}}'
    args = ["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports", selected]
    config = ConfigManager().parse_args([*args, "--training.disable_cuda_graphs"])
    apply_overrides(config.override, config)  # as Trainer.__init__ does, before any build
    assert type(config.optimizer) is QSDPOptimizersContainer.Config
    assert config.optimizer.qsdp_config == "cgx"
    assert config.optimizer.qsdp_schedule == qsdp.Schedule(own_reduce_group=True)
    assert config.optimizer.param_groups  # torchtitan's optimizer settings, kept
    assert config.training.disable_cuda_graphs


def test_override_compresses_and_trains_like_the_uncompressed_run(runs):
    plain, qsdp = runs[0][None], runs[0][RECIPE]
    assert plain["container"] == "OptimizersContainer"
    assert qsdp["container"] == "QSDPOptimizersContainer"  # the override took effect
    assert qsdp["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-3)
    assert qsdp["losses"][-1] < 0.9 * qsdp["losses"][0], qsdp["losses"]  # it learns
    assert qsdp["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.02), (plain, qsdp)
    assert qsdp["losses"] != plain["losses"]  # what crossed the wire was compressed


def test_bytes_are_counted_and_fewer(runs):
    plain, qsdp = runs[0][None], runs[0][RECIPE]
    assert plain["dist_bytes"] > 4 * plain["numel"] * STEPS // 2  # at least the reduce-scatters
    # 4-bit weight differences, 4-bit two-level gradients, scales, raw 1-D parameters
    assert 0 < qsdp["qsdp_bytes"] < 0.2 * plain["dist_bytes"], (plain, qsdp)
    # qsdp's counter is what it handed to torch.distributed: all that crossed, but the loop's
    # own scalars (the loss) and the NaN/Inf verdict's flags
    assert qsdp["qsdp_bytes"] <= qsdp["dist_bytes"] < qsdp["qsdp_bytes"] + 1024, qsdp


def test_every_rank_ends_alike(runs):
    for name in (None, RECIPE):
        assert len({r[name]["checksum"] for r in runs}) == 1
        assert len({tuple(r[name]["losses"]) for r in runs}) == 1


def test_unsupported_setups_raise_on_every_rank(runs):
    misuse = runs[0]["misuse"]
    assert all(r["misuse"] == misuse for r in runs)  # every rank, the same message
    assert "name a recipe" in misuse["no recipe"]
    assert "unknown recipe 'w3'" in misuse["unknown recipe"]
    assert "use staleness 0" in misuse["stale"]
    assert "['stalenes']" in misuse["schedule field"]
    assert "data_parallel_replicate_degree" in misuse["hsdp"]
