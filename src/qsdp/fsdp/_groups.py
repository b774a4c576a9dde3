"""FSDP2's own view of a model's parameter groups: what ``compress_fsdp`` builds its hooks for.

[Note: ask FSDP2 what it did]
Every FSDPModule holds one parameter group (``FSDPParamGroup``) and that group's *mesh info*:
the process group it shards over and, under native HSDP, the one it replicates over. That is the
only reliable answer to "which ranks does this module's all-gather and reduce-scatter run on".
The parameters' own mesh is not: under tensor parallelism a parameter is a DTensor on the
(dp, tp) mesh, dp and tp concatenated, and reading its last dimension as the shard group (and
its first as a replicate group) mistakes TP for FSDP (qsdp trained silently wrong that way,
issue 31). :func:`fsdp_groups` reads ``mesh_info`` and the group's ``fsdp_params`` (each
parameter's module, name, padded shard size and original size: the layout of the flat buffers
FSDP2 hands the hooks), which no public API exposes, through ``_get_fsdp_state()``; both exist
in torch 2.11 and 2.13. Where they are missing, it raises naming the torch version instead of
guessing. TP's own collectives (the row-wise all-reduce, sequence-parallel gathers) are DTensor
redistributions that never pass through FSDP2's hooks: they stay PyTorch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..runtime.placement import local_of

__all__ = ["FSDPGroup", "ParamSlot", "fsdp_groups"]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its group's flat all-gather / reduce-scatter chunk."""

    name: str
    """Its name in the model (``model.get_parameter(name)``)."""
    elements: int
    """Elements it takes in each rank's chunk (its padded shard)."""
    shape: tuple[int, ...]
    """Its full (unsharded) shape as FSDP2 sees it (under TP: the TP-local shape)."""
    requires_grad: bool
    """Whether it has a slot in the reduce-scatter's chunk too."""


@dataclass(frozen=True, eq=False)
class FSDPGroup:
    """One FSDPModule's parameter group as FSDP2 itself set it up ([Note: ask FSDP2 what it
    did])."""

    name: str
    """The module's name in the model (``""``: the root)."""
    module: FSDPModule
    shard_group: dist.ProcessGroup | None
    """The group FSDP2 all-gathers and reduce-scatters over (None: no parameters of its own)."""
    replicate_group: dist.ProcessGroup | None
    """Native HSDP: the group FSDP2 all-reduces the reduced shards over; else None."""
    params: tuple[nn.Parameter, ...]
    """The sharded parameters the group manages (not those of nested FSDP modules)."""
    slots: tuple[ParamSlot, ...]
    """Each parameter's slot in the all-gather's chunk, in chunk order."""
    param_dtype: torch.dtype | None
    """What FSDP2 gathers in (``MixedPrecisionPolicy.param_dtype``, else the parameters')."""
    reduce_dtype: torch.dtype | None
    """What FSDP2 reduces in (``MixedPrecisionPolicy.reduce_dtype``, else ``param_dtype``)."""

    @property
    def shard_ranks(self) -> tuple[int, ...] | None:
        """The global ranks of :attr:`shard_group`."""
        return _ranks(self.shard_group)

    @property
    def replicate_ranks(self) -> tuple[int, ...] | None:
        """The global ranks of :attr:`replicate_group`."""
        return _ranks(self.replicate_group)

    def layout(self, *, grads_only: bool) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(name, elements per rank, shape)`` of each slot of the all-gather's chunk, or with
        ``grads_only`` of the reduce-scatter's (parameters with gradients only)."""
        return [
            (s.name, s.elements, s.shape) for s in self.slots if s.requires_grad or not grads_only
        ]

    @property
    def device(self) -> torch.device:
        """Where the group's shards live (CPU for a group without parameters)."""
        for p in self.params:
            return local_of(p).device
        return torch.device("cpu")


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def fsdp_groups(model: nn.Module) -> list[FSDPGroup]:
    """Every FSDPModule of ``model`` (in ``model.modules()`` order) with its parameter group as
    FSDP2 set it up: shard and replicate groups, parameters, chunk layout and wire dtypes.

    Args:
        model: a model whose modules were wrapped by ``fully_shard`` (FSDP2 sets the groups up
            in ``fully_shard``; its dtypes are resolved again at the first forward).

    Raises:
        ValueError: this torch version keeps the parameter group elsewhere (see [Note: ask
            FSDP2 what it did]).
    """
    names = {m: n for n, m in model.named_modules()}
    return [
        _group(m, names.get(m, ""), names) for m in model.modules() if isinstance(m, FSDPModule)
    ]


def _group(module: FSDPModule, name: str, names: dict) -> FSDPGroup:
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # no parameters of its own: FSDP2 never gathers or reduces for it
            return FSDPGroup(name, module, None, None, (), (), None, None)
        info = group.mesh_info
        shard = getattr(info, "shard_process_group", None)
        replicate = getattr(info, "replicate_process_group", None)
        slots, params = [], []
        for p in group.fsdp_params:
            where = p._module_info
            owner = names.get(where.module, name)
            slots.append(
                ParamSlot(
                    name=".".join(x for x in (owner, where.param_name) if x),
                    elements=p.padded_sharded_param_size.numel(),
                    shape=tuple(p._orig_size),
                    requires_grad=p.sharded_param.requires_grad,
                )
            )
            params.append(p.sharded_param)
        policy = group.mp_policy
        gathered = policy.param_dtype or (params[0].dtype if params else None)
        return FSDPGroup(
            name=name,
            module=module,
            shard_group=shard,
            replicate_group=replicate,
            params=tuple(params),
            slots=tuple(slots),
            param_dtype=gathered,
            reduce_dtype=policy.reduce_dtype or gathered,
        )
    except AttributeError as e:
        raise ValueError(
            f"qsdp reads FSDP2's parameter groups (mesh info, parameter layout) through "
            f"FSDPModule._get_fsdp_state()._fsdp_param_group, which torch {torch.__version__} "
            f"keeps elsewhere ({e}); qsdp supports torch 2.11 to 2.13"
        ) from e
