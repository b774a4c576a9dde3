"""torchtitan: qsdp selected in a torchtitan 0.3 job config, through torchtitan's own override
mechanism (``pip install 'qsdp[torchtitan]'``)::

    torchrun --nproc-per-node 8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --training.disable_cuda_graphs \\
        --override.imports 'qsdp.integrations.torchtitan.compress={"recipe": "sdp4bit"}'

[Note: where the adapter reaches the model]
torchtitan 0.3 has no hook that runs after ``fully_shard``: its model converters
(``ModelConfigConverter``: float8, MX, LoRA) rewrite the model *config* before the model is
built (``torchtitan/models/llama3/__init__.py``, ``model_registry``), ``parallelize_fn`` and
``post_optimizer_build_fn`` are callables of the ``ModelSpec``, which the job config cannot
select (``torchtitan/protocols/model_spec.py``: "the callable fields are intentionally not
traversable"). What a job config selects is a component's ``Config``, through
``--override.imports`` (``torchtitan/config/override.py``). The first component
``Trainer.__init__`` builds from the parallelized model is the optimizer container::

    Trainer.__init__ (torchtitan/trainer.py)
      apply_overrides(config.override, config)     <- compress(): config.optimizer becomes
                                                      QSDPOptimizersContainer.Config
      model = parallelize_fn(model, ...)            TP, activation checkpointing, compile,
                                                    fully_shard per block, then the root
      model.to_empty(...); model.init_weights()
      config.optimizer.build(model_parts=[model])   <- QSDPOptimizersContainer.__init__:
                                                        qsdp.compress_fsdp(model, recipe, ...)
                                                        then torchtitan's own container
      ... first forward in train()

so :func:`compress` (the ``@override`` a user names) swaps torchtitan's
``OptimizersContainer.Config`` for :class:`QSDPOptimizersContainer`'s, which hands each model
part to :func:`qsdp.compress_fsdp` and then builds the optimizers exactly as torchtitan does
(torchtitan documents subclassing the container as its way to customise it). Nothing of
torchtitan or torch is patched. Under TP ``compress_fsdp`` compresses FSDP2's data-parallel
collectives only (it reads FSDP2's own groups: docs/architecture.md).

Two translations of calling conventions, no more:
- torchtitan scales the loss by the global token count and turns FSDP2's gradient division
  off (``set_gradient_divide_factor(1.0)`` in ``torchtitan/distributed/fsdp.py``), which FSDP2
  sends as ``PREMUL_SUM(1.0)``; qsdp reduces with AVG or SUM, so the container asks FSDP2
  for the same sum as ``ReduceOp.SUM`` (``set_force_sum_reduction_for_comms(True)``, FSDP2's
  public setter, which torchtitan's own symmetric-memory option calls).
- :meth:`QSDPOptimizersContainer.step` reads each backward's NaN/Inf verdict before the
  update (qsdp otherwise reads it when the next backward ends; torchtitan's loop has no hook
  after its last step).

Every check reads the launch configuration or what FSDP2 built, the same on every rank, so
every rank raises the same error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

# qsdp's public names only (tests/test_layering.py)
from .. import CompressionConfig, Schedule
from .. import recipe as named_recipe
from ..fsdp import fsdp_groups
from ._installed import Compressed, install

try:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.override import derive, override
except ImportError as e:  # pragma: no cover - depends on the extra
    raise ImportError(
        f"qsdp.integrations.torchtitan needs torchtitan 0.3 ({e}); install it with "
        "pip install 'qsdp[torchtitan]' (torchtitan 0.3 needs torch>=2.12: "
        "torch.distributed.fsdp.DataParallelMeshDims)"
    ) from e

__all__ = ["TARGET", "QSDPOptimizersContainer", "compress"]

TARGET = "qsdp.integrations.torchtitan.compress"
"""What a job config names in ``override.imports`` (CLI: ``--override.imports``)."""

_WHERE = "qsdp.integrations.torchtitan"
_EXAMPLE = f'--override.imports \'{TARGET}={{"recipe": "sdp4bit"}}\''


class QSDPOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container, built after it compressed the collectives of each
    model part with :func:`qsdp.compress_fsdp` ([Note: where the adapter reaches the model]).

    Made by :func:`compress` through ``--override.imports``; ``trainer.optimizers`` is this
    container, its ``compressed`` the model and qsdp's state (``.state``) and bytes
    (``.stats``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        qsdp_config: CompressionConfig | str = "auto"
        """A :class:`qsdp.CompressionConfig` or a recipe name (``"sdp4bit"``, ...)."""
        qsdp_schedule: Schedule = field(default_factory=Schedule)
        """When and on which communicators qsdp's collectives run (synchronous only here)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(
                f"{_WHERE}: {len(model_parts)} model parts on this rank (pipeline parallelism "
                "with several stages a rank); qsdp's torchtitan adapter supports one: use "
                "parallelism.pipeline_parallel_degree=1"
            )
        part = model_parts[0]
        _check_model(part, config.qsdp_config)
        for module in part.modules():  # [Note: where the adapter reaches the model]
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        self.compressed: Compressed = install(
            part, config.qsdp_config, schedule=config.qsdp_schedule, options={}
        )
        """The FSDP2 root qsdp compressed and qsdp's state of it (``.stats``: the bytes)."""
        part.register_forward_pre_hook(_refuse_cuda_graph_capture, prepend=True)
        super().__init__(config, model_parts=model_parts)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        # the last backward's NaN/Inf verdict, read before its update ([Note: where ...])
        self.compressed.state.check_nonfinite()
        return super().step(*args, **kwargs)


@override(
    target=OptimizersContainer.Config,
    description="qsdp: compressed FSDP2 collectives (qsdp.compress_fsdp)",
)
def compress(
    config: OptimizersContainer.Config,
    *,
    recipe: CompressionConfig | str | None = None,
    schedule: dict[str, Any] | Schedule | None = None,
) -> QSDPOptimizersContainer.Config:
    """The override a torchtitan job config names to compress FSDP2's collectives with qsdp.

    Selected with ``--override.imports 'qsdp.integrations.torchtitan.compress={"recipe":
    "sdp4bit"}'`` (or ``config.override.imports = [(TARGET, {"recipe": "sdp4bit"})]`` in a
    config-registry function); torchtitan calls it on every rank before it builds anything.

    Args:
        config: torchtitan's ``OptimizersContainer.Config`` (kept: the optimizers are built
            from it unchanged).
        recipe: a recipe name (``"sdp4bit"``, ``"qsdp-w8g8"``, ``"cgx"``, ``"auto"``, ...) or,
            from Python, a :class:`qsdp.CompressionConfig`.
        schedule: :class:`qsdp.Schedule` fields as a JSON object (``{"own_reduce_group":
            false}``), or a ``Schedule``; synchronous only.

    Returns:
        The :class:`QSDPOptimizersContainer` config that replaces ``config``.

    Raises:
        ValueError: no recipe or an unknown one, another optimizer container (e.g. torchft's),
            an unknown schedule field, or ``staleness=1`` (torchtitan's loop neither skips the
            first ``optimizer.step()`` nor drains).
    """
    if type(config) is not OptimizersContainer.Config:
        raise ValueError(
            f"{_WHERE}: the optimizer is a {type(config).__qualname__}; qsdp's adapter extends "
            "torchtitan's OptimizersContainer only: drop one of the two overrides"
        )
    if recipe is None:
        raise ValueError(f"{_WHERE}: name a recipe, e.g. {_EXAMPLE}")
    if isinstance(recipe, str) and recipe != "auto":
        named_recipe(recipe)  # an unknown name raises here, listing the recipes
    elif not isinstance(recipe, str | CompressionConfig):
        raise ValueError(
            f"{_WHERE}: recipe={recipe!r} must be a recipe name or a qsdp.CompressionConfig"
        )
    if not isinstance(schedule, Schedule):
        known = [f.name for f in fields(Schedule)]
        unknown = sorted(set(schedule or {}) - set(known))
        if unknown:
            raise ValueError(
                f"{_WHERE}: schedule fields {unknown} are not qsdp.Schedule's; known: {known}"
            )
        schedule = Schedule(**(schedule or {}))
    if schedule.staleness:
        raise ValueError(
            f"{_WHERE}: schedule staleness={schedule.staleness} needs a loop that skips "
            "optimizer.step() while state.applied_nothing and calls state.drain() after the "
            "last backward; torchtitan's loop does neither: use staleness 0 (the default)"
        )
    return derive(
        config, QSDPOptimizersContainer.Config, qsdp_config=recipe, qsdp_schedule=schedule
    )


def _check_model(part: nn.Module, config: CompressionConfig | str) -> None:
    """Refuse what the adapter does not support, from what FSDP2 built (the same on every
    rank)."""
    if not isinstance(part, FSDPModule):
        raise ValueError(
            f"{_WHERE}: the model is a {type(part).__name__}, not an FSDP2 module; torchtitan's "
            "parallelize_fn applies fully_shard to every llama3 model: use a model spec that "
            "does (parallelism.data_parallel_shard_degree=-1)"
        )
    groups = fsdp_groups(part)
    if any(g.replicate_group is not None for g in groups):
        raise ValueError(
            f"{_WHERE}: parallelism.data_parallel_replicate_degree > 1 (torchtitan's HSDP or "
            "DDP: fully_shard on the 2-D (dp_replicate, fsdp) mesh); there qsdp would compress "
            "only the reduce-scatter inside a replica and leave the all-reduce across "
            "replicas, the slow link, uncompressed: use data_parallel_replicate_degree=1 "
            "(FSDP2 over all data-parallel ranks), or qsdp.compress_fsdp(replicate=...) in "
            "your own loop"
        )
    if all(g.shard_group is None or g.shard_group.size() == 1 for g in groups):
        raise ValueError(
            f"{_WHERE}: one data-parallel rank (data_parallel_shard_degree 1): FSDP2 sends "
            "nothing for qsdp to compress; launch more ranks or drop the override"
        )
    weights = config == "auto" or (
        isinstance(config, CompressionConfig | str)
        and (named_recipe(config) if isinstance(config, str) else config).weights is not None
    )
    extended = sorted(
        g.name or "<root>"
        for g in groups
        for p in g.params
        if hasattr(_local(p), "fsdp_pre_all_gather")
    )
    if weights and extended:
        raise ValueError(
            f"{_WHERE}: the parameters of {extended} gather through FSDP2's all-gather "
            "extension (fsdp_pre_all_gather, e.g. torchao's float8 all-gather), which a "
            f"recipe that compresses weights ({config!r}) replaces: use a gradient recipe "
            "('cgx', 'qsdp-g8', 'tlq-hs-only') or gather those weights in high precision"
        )


def _local(p: nn.Parameter) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _refuse_cuda_graph_capture(module: nn.Module, args: Any) -> None:
    # torchtitan captures forward + backward in a CUDA graph unless
    # training.disable_cuda_graphs; qsdp's hooks decide per call on the host, which a
    # replayed graph would not run again. The container cannot see the training config.
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"{_WHERE}: torchtitan is capturing the forward and backward in a CUDA graph; "
            "qsdp's collectives decide on the host at every call, which a replay skips: "
            "pass --training.disable_cuda_graphs"
        )
