"""Weight prediction: staleness 1's gradients computed where they will be applied.

[Note: weight prediction]
At staleness 1 the gradient step ``t`` computes, at the parameters ``x_t``, is applied one step
late, to ``x_{t+1} = x_t + u_t`` (``u_t``: the update of the reduction in flight during step
``t``). Applied as is, it is a gradient of the wrong point, and the error feeds back through the
optimizer's momentum: on a GPT at lr 3e-4 with AdamW (betas 0.9, 0.95) the delayed run spikes
at the end of warm-up and ends 29% above the synchronous loss (docs/results.md). The remedy of
asynchronous pipelines (PipeMare's discrepancy correction, SpecTrain's weight prediction) is to
compute the gradient at a prediction of ``x_{t+1}``: ``x_t + u_{t-1}``, the last update applied
again, since successive updates of a momentum optimizer point the same way. No optimizer
knowledge is needed: the update is read off the parameters around ``optimizer.step()``.
Measured, it recovers part of the cost, not all: +30.5% to +18.7% on that GPT (the delay done by
hand on one GPU, ``benchmarks/staleness_reference.py``), +6.3% to +3.1% on a small CPU model.
It is for momentum optimizers: in a linear model of heavy ball (docs/results.md) it widens the
stable learning rates of a delayed run 2.7-fold at momentum 0.9, but narrows them at momentum 0
(plain SGD), where successive updates do not point the same way.

:class:`WeightPrediction` keeps one buffer per parameter (its local shard under FSDP2: 4 bytes
per parameter over the shard group for fp32 masters). ``optimizer.step()`` hooks (the
optimizer's own ``register_step_pre_hook`` / ``register_step_post_hook``) turn it into the last
update: a copy of the parameters before the step, then ``x_after - x_before``. :meth:`ahead`
adds it to the parameters for a forward and backward and subtracts it after: the gradient is
that of the predicted point, the optimizer steps from ``x_t`` (up to one rounding of the
parameter per step, the same on every rank, so replicas stay identical).

Predict only in a step whose backward applies a reduction in flight (the comm state's
``in_flight``): the first step, the synchronous step after the staleness gate fired and the
step after it apply nothing or have nothing in flight, so their gradients land where they were
computed. ``qsdp train --staleness 1`` predicts unless ``--no-predict``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .placement import like_param, local_of

__all__ = ["WeightPrediction"]


class WeightPrediction:
    """The last optimizer update of every parameter of ``optimizer``, added for a step's
    forward and backward by :meth:`ahead` (see [Note: weight prediction]).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (plain tensors, or
            FSDP2's sharded DTensors: each rank predicts its own shard).

    A ``torch.distributed.checkpoint`` ``Stateful``: save it with the optimizer so a resumed
    run predicts as an uninterrupted one. :meth:`remove` takes the optimizer hooks off.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"WeightPrediction takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.update: list[torch.Tensor] | None = None
        """The last update of each parameter's local tensor, or None before the first step."""
        self._ahead = False
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def _locals(self) -> list[torch.Tensor]:
        return [local_of(p.detach()) for p in self.params]

    def _before_step(self, *_: object) -> None:
        if self._ahead:
            raise RuntimeError(
                "optimizer.step() inside WeightPrediction.ahead(): the parameters are the "
                "predicted ones; step after the block (after the backward)"
            )
        xs = self._locals()
        if self.update is None:
            self.update = [torch.empty_like(x) for x in xs]
        torch._foreach_copy_(self.update, xs)

    def _after_step(self, *_: object) -> None:
        # update = x_after - x_before, in place of the copy
        torch._foreach_sub_(self.update, self._locals())
        torch._foreach_neg_(self.update)

    @contextlib.contextmanager
    def ahead(self, *, enabled: bool = True) -> Iterator[None]:
        """Within: the parameters are ``x + u`` (``u`` the last update); run the step's forward
        and backward here. ``enabled=False``, or before the first ``optimizer.step()``: the
        parameters as they are."""
        if self._ahead:
            raise RuntimeError("WeightPrediction.ahead() is not reentrant")
        shift = enabled and self.update is not None
        xs = self._locals() if shift else []
        if shift:
            with torch.no_grad():
                torch._foreach_add_(xs, self.update)
        self._ahead = True
        try:
            yield
        finally:
            self._ahead = False
            if shift:
                with torch.no_grad():
                    torch._foreach_sub_(xs, self.update)

    def remove(self) -> None:
        """Take the hooks off the optimizer; the prediction stops tracking its steps."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The last update of each parameter, shaped and placed as the parameter (a DTensor
        for FSDP2's sharded ones), under ``update.<i>``; ``has_update`` says whether any step
        was taken."""
        has = int(self.update is not None)
        state: dict[str, torch.Tensor] = {"has_update": torch.tensor([has])}
        for i, p in enumerate(self.params):
            local = self.update[i] if self.update is not None else torch.zeros_like(local_of(p))
            state[f"update.{i}"] = like_param(local.clone(), p)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        count = sum(1 for k in state if k.startswith("update."))
        if count != len(self.params):
            raise ValueError(
                f"this weight-prediction state has {count} parameters, the optimizer "
                f"{len(self.params)}: it was saved from another model or optimizer"
            )
        if not int(state["has_update"]):
            self.update = None
            return
        self.update = [
            local_of(state[f"update.{i}"]).to(local_of(p).device, local_of(p).dtype).clone()
            for i, p in enumerate(self.params)
        ]
