"""How ``qsdp train`` parallelises its GPT: FSDP2, compressed HSDP or compressed DDP.

[Note: three ways, one loop]
The training loop calls ``Parallel.model`` and asks ``Parallel`` for the rest: the byte counter
(``stats``), the collectives' checkpoint state (``state``), how a micro-batch that must not
synchronise runs (``micro_step``), and the uncompressed reference bytes (``reference_bytes``).

- ``fsdp``: every block and the root ``fully_shard``-ed over the world, ``qsdp.compress_fsdp``;
  two-level recipes (and ``auto``, which may choose two levels) get a (nodes, GPUs per
  node) mesh under torchrun on several nodes, or with ``--nodes`` emulated on one host.
- ``hsdp``: every block and the root ``fully_shard``-ed over the GPUs of a node, and
  ``compress_fsdp(..., replicate=...)`` compresses the all-reduce across the nodes with the
  recipe's gradient config (a gradient-only or weight recipe whose gradients all-reduce: ``cgx``,
  ``qsdp-g8``, ``global-qsgd``, ``bf16``...). Nodes: torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``,
  or ``--nodes`` emulated on one machine.
- ``ddp``: ``DistributedDataParallel`` with ``qsdp.ddp.register`` (gradient-only recipes); on
  GPUs the forward runs under bf16 autocast (FSDP2's runs use bf16 parameters).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from qsdp import CompressionConfig, Schedule, recipe
from qsdp import ddp as qddp
from qsdp.comm import CommStats
from qsdp.fsdp import comm_state, compress_fsdp, fsdp_comm_stats, fsdp_groups

from .model import GPT, ModelConfig

__all__ = ["MODES", "Parallel", "build"]

MODES = ("fsdp", "hsdp", "ddp")


@dataclass
class Parallel:
    """The parallelised model and what the loop needs of it (see the module's note)."""

    mode: str
    model: nn.Module
    """What the loop calls and checkpoints: the FSDP2 root, or the DDP wrapper."""
    gpt: GPT
    """The GPT itself (its config, its blocks)."""
    stats: CommStats
    state: object
    """The collectives' ``torch.distributed.checkpoint`` ``Stateful``."""
    config: CompressionConfig | None = None
    """The compression config the model runs (for ``"auto"``: the recipe it chose)."""
    schedule: Schedule = Schedule()
    """When and on which communicators its collectives run."""
    bf16_autocast: bool = False
    shard_size: int = 1
    """Ranks a parameter is sharded over (the world for FSDP2, a node for HSDP, 1 for DDP)."""
    replica_group: dist.ProcessGroup | None = None
    """This rank's replicas (HSDP: the replicate group; DDP: None, the world)."""

    @property
    def replicated(self) -> bool:
        """Whether ranks hold replicas of the parameters (DDP, HSDP): checked before every
        checkpoint ([Note: checking replicas] in ``qsdp.runtime.replicas``)."""
        return self.mode in ("ddp", "hsdp")

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's forward and backward: gradients are synchronised
        only on the ``last`` of a step's micro-batches."""
        if self.mode == "ddp":
            return contextlib.nullcontext() if last else self.model.no_sync()
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.bf16_autocast:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def reference_bytes(
        self, config: CompressionConfig, compute_bytes: int, accum: int
    ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Per step, by qsdp's byte convention: the (all-gather, reduce-scatter, all-reduce)
        bytes of the uncompressed run, and those of the collectives qsdp leaves to PyTorch
        (counted by no hook). See the trainer's [Note: bytes on the wire]."""
        if self.mode == "ddp":  # DDP's all-reduce of fp32 gradients, once per step
            full_ar = 4 * sum(p.numel() for p in self.gpt.parameters())
            return (0, 0, full_ar), (0, 0, 0)  # the hook counts even the uncompressed one
        ag = rs = shard_total = 0
        s = self.shard_size
        for group in fsdp_groups(self.model):
            shard = sum(s.elements for s in group.slots)
            shard_total += shard
            gathers = 1 if group.module is self.model else 2  # the root is not resharded
            ag += accum * gathers * shard * compute_bytes
            rs += (s - 1) * shard * 4  # the chunks that leave for the peers
        plain_ag = 0 if config.weights is not None else ag
        if self.mode == "fsdp":
            # staleness and an own reduce group move FSDP2's reduction into a counted hook
            hooked = config.grads is not None or self.schedule.own_group(config)
            return (ag, rs, 0), (plain_ag, 0 if hooked else rs, 0)
        # HSDP: FSDP2's own reduce-scatter inside the node; the replicate all-reduce of the
        # fp32 shard, counted by qsdp's hook (compressed or not)
        return (ag, rs, 4 * shard_total), (plain_ag, rs, 0)


def _nodes(cfg_nodes: int | None, ws: int) -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    nodes = cfg_nodes or (ws // local if 1 <= local < ws else 2)
    if nodes < 2 or ws % nodes:
        raise ValueError(
            f"--hsdp with {nodes} nodes over {ws} ranks: the nodes must divide the ranks and be "
            f"at least 2; pass --nodes (e.g. --nodes 2 with --nproc 4)"
        )
    return nodes


def _mesh(device: torch.device, use: bool, nodes: int | None) -> DeviceMesh | None:
    """The (inter, intra) mesh of a two-level recipe (or ``auto``, which may choose two levels):
    ``nodes`` emulated nodes, else torchrun's under torchrun on several nodes, else None."""
    if not use:
        return None
    ws = dist.get_world_size()
    if nodes is not None:
        if ws % nodes or ws // nodes < 2:
            raise ValueError(
                f"--nodes={nodes} over {ws} ranks: two levels need the nodes to divide the ranks "
                f"with at least 2 ranks per node (e.g. --nodes 2 with 4 ranks)"
            )
        local = ws // nodes
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    if local <= 1 or local >= ws or ws % local:
        return None  # one node (or one GPU per node): every peer is remote or all are local
    return init_device_mesh(device.type, (ws // local, local), mesh_dim_names=("inter", "intra"))


def build(
    *,
    mode: str,
    recipe_name: str,
    mc: ModelConfig,
    device: torch.device,
    seed: int,
    bf16: bool,
    two_level: bool,
    nodes: int | None,
    config: CompressionConfig | str | None = None,
    error_feedback: bool = False,
    ddp_bucket_mb: float | None = None,
    schedule: Schedule | None = None,
) -> Parallel:
    """Build the GPT on ``device`` from ``seed`` and parallelise it as ``mode`` says."""
    if mode not in MODES:
        raise ValueError(f"parallel mode {mode!r} must be one of {MODES}")
    torch.manual_seed(seed)
    with device:
        gpt = GPT(mc)
    config = config or recipe(recipe_name)  # the recipe with the run's overrides
    schedule = schedule or Schedule()
    if mode == "ddp":
        model = DDP(
            gpt,
            device_ids=[device.index] if device.type == "cuda" else None,
            **({"bucket_cap_mb": ddp_bucket_mb} if ddp_bucket_mb is not None else {}),
        )
        state = qddp.register(model, config, schedule=schedule, error_feedback=error_feedback)
        return Parallel(
            mode,
            model,
            gpt,
            state.stats,
            state,
            config=state.config,
            schedule=state.schedule,
            bf16_autocast=bf16,
        )
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    ws = dist.get_world_size()
    shard_mesh = replicate = None
    if mode == "hsdp":
        n = _nodes(nodes, ws)
        mesh = init_device_mesh(device.type, (n, ws // n), mesh_dim_names=("replicate", "shard"))
        shard_mesh, replicate = mesh["shard"], mesh["replicate"]
    for block in gpt.blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=mp)
    fully_shard(gpt, mesh=shard_mesh, mp_policy=mp)
    if mode == "hsdp":
        compress_fsdp(gpt, config, replicate=replicate, schedule=schedule)
    elif config == "auto":  # it may choose two levels on the mesh
        compress_fsdp(gpt, config, mesh=_mesh(device, two_level, nodes), schedule=schedule)
    else:
        mesh = _mesh(device, two_level and config.two_level, nodes)
        compress_fsdp(gpt, config, mesh=mesh, schedule=schedule)
    shard = shard_mesh.size() if shard_mesh is not None else ws
    state = comm_state(gpt)
    return Parallel(
        mode,
        gpt,
        gpt,
        fsdp_comm_stats(gpt),
        state,
        config=state.config,
        schedule=state.schedule,
        shard_size=shard,
        replica_group=replicate.get_group() if replicate is not None else None,
    )
