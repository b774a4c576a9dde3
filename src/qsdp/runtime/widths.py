"""Adaptive widths at run time: measure in the hooks, decide once per backward, apply everywhere.

[Note: adaptive widths at run time]
A model's reduction hooks (FSDP2's reduce-scatters, DDP's buckets) share one
:class:`WidthController`. Its steps are the backwards that reduce. In a *measuring* backward
(step ``warmup``, then every ``every`` steps) each hook hands the controller the compressed part
of its gradient before reducing it (:meth:`WidthController.observe`), which measures the squared
quantization error at every allowed width (``qsdp.policy.adaptive.measure_errors``: sampled, on
the device). When the backward ends (an autograd final callback, queued by the first hook of the
backward), rank 0's tables decide the plan (``choose_widths``: fewest bytes at no more total
error than the config's uniform width), one broadcast gives every rank rank 0's widths, and from
the next backward on each hook reduces at its group's width. Payload sizes follow from the
widths, so every rank sends and expects the same bytes. Groups are keyed by the hook's
position (FSDP2) or the bucket index (DDP), the same on every rank. The widths and the step
count are part of the integration's checkpoint state (``state_dict``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..policy.adaptive import WidthPlan, agree, choose_widths, measure_errors
from ..quant import QuantSpec
from .nonfinite import _graph_task

__all__ = ["WidthController"]


class WidthController:
    """Per-group gradient widths of one model, re-decided every ``config.every`` steps.

    Args:
        config: the :class:`qsdp.AdaptiveWidths` settings.
        reference: the config's own width, the plan's error budget and every group's width
            until the first decision.
        seed: the noise key of the error measurement's stochastic rounding.
    """

    def __init__(self, config, *, reference: int, keys: int, seed: int = 0) -> None:
        self.config, self.reference, self.seed = config, reference, seed
        self.keys = keys
        """Group keys are ``0 .. keys - 1`` (the checkpoint's fixed shape)."""
        self.steps = 0
        """Backwards that reduced so far."""
        self.widths: dict[int, int] = {}
        """Each group's width (absent: ``reference``)."""
        self.plan: WidthPlan | None = None
        """The last decision (bytes and error against the reference), for the metrics."""
        self.decisions = 0
        self._tables: dict[int, tuple[dict[int, float], dict[int, int]]] = {}
        self._queued = -1

    def measuring(self) -> bool:
        c = self.config
        return self.steps >= c.warmup and (self.steps - c.warmup) % c.every == 0

    def width(self, key: int) -> int:
        return self.widths.get(key, self.reference)

    def observe(self, key: int, compressed: Callable[[], torch.Tensor], spec: QuantSpec) -> None:
        """In a hook, before reducing: count the backward and, when it measures, record this
        group's errors (``compressed()``: the part its quantizer encodes, called only then;
        ``spec``: that quantizer at any width)."""
        task = _graph_task()
        if task == -1:
            return  # outside a backward there is no step to count: nothing changes
        if task != self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
            self._queued = task
        if self.measuring():
            part = compressed()
            if not part.numel():
                return
            errors, nbytes = measure_errors(
                [part],
                spec,
                widths=self.config.widths,
                sample=self.config.sample,
                seed=self.seed,
                relative=self.config.error == "relative",
            )
            self._tables[key] = (errors[0], nbytes[0])

    def _end(self) -> None:
        """The backward's end: decide when it measured, count it."""
        self._queued = -1
        if self.measuring() and self._tables:
            keys = sorted(self._tables)
            errors = [self._tables[k][0] for k in keys]
            plan = None
            # a NaN/Inf gradient (judged by the NaN/Inf check) cannot be measured: this rank
            # keeps its widths, and still takes part in the broadcast, so no rank waits alone
            if all(math.isfinite(v) for e in errors for v in e.values()):
                plan = choose_widths(
                    errors, [self._tables[k][1] for k in keys], reference=self.reference
                )
            local = plan.widths if plan else tuple(self.width(k) for k in keys)
            widths = agree(local) if dist.is_initialized() else local
            self.widths = dict(zip(keys, widths, strict=True))
            self.decisions += 1
            self.plan = plan if plan and widths == plan.widths else self.plan
        self._tables = {}
        self.steps += 1

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The step count and every group's width (0: the reference)."""
        widths = torch.zeros(self.keys, dtype=torch.int64)
        for k, w in self.widths.items():
            widths[k] = w
        return {"width_steps": torch.tensor([self.steps]), "widths": widths}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.steps = int(state["width_steps"][0])
        self.widths = {k: int(w) for k, w in enumerate(state["widths"].tolist()) if w}
