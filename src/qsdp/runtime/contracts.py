"""The contracts between the runtime and the integrations, as ``typing.Protocol``.

[Note: contracts, not duck types]
The runtime serves every integration (FSDP2's hooks, compressed HSDP's, DDP's comm hook, and
the next one): :class:`qsdp.runtime.NonfiniteCheck` reports the reductions whose gradients it
zeroed, :class:`qsdp.runtime.WeightPrediction` predicts from the gradients a staleness-1 state
keeps, the trainer drives staleness 1 through its state. Each of these used to take an
``object`` and call methods on it; these protocols name what they call, so an integration
sees what it must offer and a wrong argument fails at once with a ``TypeError`` naming the
missing methods (``check_contract``), not inside a backward. Both integrations' states satisfy
:class:`StalenessState` (tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["FlaggedReduction", "LocalGradients", "StalenessState", "check_contract"]


@runtime_checkable
class FlaggedReduction(Protocol):
    """A reduction whose NaN/Inf flags :class:`qsdp.runtime.NonfiniteCheck` holds: how to
    name it in a report, and a counter of its zeroed results."""

    module_name: str
    """The FSDP module it reduces for (``""``: none, see :attr:`where`)."""
    where: str
    """What a report names when it is not an FSDP module (``""``: the module)."""
    layout: list[tuple[str, int]] | None
    """``(parameter name, elements)`` of the flags' runs, or None: one flag for all."""
    zeroed: int
    """Results zeroed for NaN/Inf so far (counted when read)."""


@runtime_checkable
class LocalGradients(Protocol):
    """Each rank's own gradient of the step in flight at staleness 1, for
    :class:`qsdp.runtime.WeightPrediction` (``local=``)."""

    def keep_local_gradients(self) -> None: ...

    def local_gradients(self, *, take: bool = False) -> dict[nn.Parameter, torch.Tensor]: ...

    def estimate_square_norm(self, estimates: dict) -> torch.Tensor: ...


@runtime_checkable
class StalenessState(LocalGradients, Protocol):
    """Staleness 1 as a training loop drives it, the same for FSDP2
    (``qsdp.fsdp.comm_state(model)``) and DDP (what ``qsdp.ddp.register`` returns)."""

    @property
    def in_flight(self) -> bool: ...

    @property
    def applied_nothing(self) -> bool: ...

    def drain(self) -> None: ...

    def synchronous(self) -> AbstractContextManager[None]: ...

    def check_nonfinite(self) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


def check_contract(value: object, contract: type, *, what: str) -> None:
    """Raise ``TypeError`` naming what ``value`` lacks of ``contract`` (a protocol above)."""
    if isinstance(value, contract):
        return
    missing = sorted(
        name
        for name in _members(contract)
        if not hasattr(value, name)  # (attributes set in __init__ count)
    )
    raise TypeError(
        f"{what} needs a {contract.__name__} ({contract.__doc__.splitlines()[0].strip()}); "
        f"{type(value).__name__} lacks {missing or 'some of its members'}"
    )


def _members(contract: type) -> Iterator[str]:
    for klass in contract.__mro__:
        if klass is object or klass is Protocol:
            continue
        yield from getattr(klass, "__annotations__", {})
        for name, value in vars(klass).items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                yield name
