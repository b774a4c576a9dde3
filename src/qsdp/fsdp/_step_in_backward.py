"""Staleness 1 with each FSDP module's optimizer step in the backward, and the next step's
weight gathers started there.

[Note: the step in the backward]
At staleness 1 the update of step ``t`` is ``x_{t+1} = x_t - lr * clip(g_{t-1})``: it needs
nothing of step ``t``'s own gradient. With the optimizer step after the backward (the plain
loop), the gathers of step ``t + 1`` start only when its forward does, and on a slow link the
forward waits for them (profiled on 4x H200 over sockets: 5.6 ms of wire per block against
2.6 ms of forward compute), while in the backward the link carries only the delayed
reductions. :class:`StepInBackward` moves each module's update into the backward, right after
that module's own backward, and starts its gather for step ``t + 1`` there, on a stream of its
own, so the gathers share the link with the delayed reductions (in the other direction) and
hide behind the backward's compute:

1. When the backward's first staleness hook is about to apply the results of step ``t - 1``
   (``Pipeline.on_apply``), every result is complete (the hook's stream waits for them) and
   read: NaN/Inf flags of every group, agreed in one MAX all-reduce and read on the host (one
   host sync per step: a non-finite result raises on every rank before any parameter moves, or
   zeroes its group under ``nonfinite="zero"``, as the plain loop's check would), and, with
   ``clip``, the global norm of the applied gradient, exactly as
   ``clip_grad_norm_(model.parameters(), clip)`` computes it after the backward.
2. FSDP2 puts each module's result into its sharded ``.grad`` and then runs the parameters'
   post-accumulate-grad hooks (``torch.Tensor.register_post_accumulate_grad_hook``, on FSDP2's
   post-reduce stream). When a module's last parameter has its gradient, the gradients are
   clipped with the global coefficient, the last-update prediction (``predict="last"``) is
   taken back, and ``optimizer.step()`` runs: only this module's parameters have gradients
   (the others are None: not reduced yet, or stepped and cleared), so only they move, each as
   the plain loop's step would move it. Then the prediction for step ``t + 1`` is applied.
3. ``FSDPModule.unshard(async_op=True)`` starts the module's gather for step ``t + 1``, marked
   as of the next step's clock epoch. FSDP2 drops an unshard left pending when the backward
   ends (``finalize_backward`` waits for it and frees its buffer), but a weight-difference (and
   a quantized-master) gather keeps what it gathered: the next forward's gather and the next
   backward's re-gather are served from it without communication, bit for bit what the forward
   would have gathered. So prefetching needs those gathers (``sdp4bit``, ``qwd-only``,
   ``qsdp-master``...); ``prefetch=False`` steps in the backward without it.

The iterates, losses, noise keys and bytes are those of the plain loop at staleness 1 (tested
on gloo, bit for bit). The cost: the prefetched gathers' buffers (2 bytes per parameter of the
modules already stepped, in bf16) are held until the backward ends, while the backward frees
activations; the gradients of a stepped module are released at once.

Not supported: compressed HSDP (its all-reduce hooks), ``WeightPrediction(local=...)`` (its
clipping needs the norm of the whole estimate, known only when the backward ends),
``synchronous()`` backwards (the plain loop steps those: :meth:`StepInBackward.finish` says
so), and anything that steps or reads the parameters between a backward and the next forward
without :meth:`StepInBackward.settle` (the parameters hold the prediction there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.nonfinite import nonfinite_flags
from ..runtime.placement import like_param, local_of
from ._gathers import QuantizedMasterAllGather, WeightDiffAllGather
from ._stale import _by_param, _check_avg
from ._state import _installed

__all__ = ["StepInBackward"]

_PREDICTIONS = ("none", "last")


class _Unit:
    """One FSDP module's group: its parameters, gather and reduction."""

    def __init__(self, module: nn.Module, hook: object, params: list, gather: object) -> None:
        self.module, self.hook, self.gather = module, hook, gather
        self.params: list[nn.Parameter] = [p for p, _ in params]
        self.arrived: set[int] = set()
        self.stepped = False
        self.update: list[torch.Tensor] | None = None
        """The last update of each local shard (``predict="last"``), or None before one."""
        self.shifted = False
        """The parameters hold the prediction (``x + update``)."""


class StepInBackward:
    """Each FSDP module's optimizer step in the backward, and its next gather started there,
    for a model compressed at staleness 1 (see [Note: the step in the backward]).

    Args:
        model: the root FSDP module passed to ``qsdp.compress_fsdp`` with ``staleness=1``.
        optimizer: the optimizer over exactly ``model.parameters()``; set its learning rate for
            the update a step applies before that step's backward.
        clip: clip the applied gradient's global norm to it, as
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip)`` after the backward
            would; None: no clipping.
        predict: ``"last"``: the forward and backward compute at the last update applied once
            more (as :class:`qsdp.WeightPrediction(optimizer)` does); ``"none"``: at the
            parameters.
        prefetch: start each module's gather for the next step in the backward (needs
            weight-difference or quantized-master gathers).

    Use::

        sib = StepInBackward(model, opt, clip=1.0, predict="last")
        for batch in data:
            loss_fn(model(batch)).backward()   # each module steps once its backward is done
            if sib.finish() is None and not qsdp.fsdp.comm_state(model).applied_nothing:
                opt.step()                     # a backward that did not step (synchronous())
            opt.zero_grad(set_to_none=True)
        sib.settle()                           # the parameters as stepped, no prefetch left
        qsdp.fsdp.comm_state(model).drain(); opt.step()

    Call on every rank; :meth:`remove` takes the hooks off.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        clip: float | None = None,
        predict: str = "none",
        prefetch: bool = True,
    ) -> None:
        pipeline = _installed(model).pipeline
        if pipeline is None:
            raise ValueError(
                "StepInBackward applies staleness 1's delayed gradients in the backward: compress "
                "the model with a config at staleness=1 (qsdp.recipe(name, staleness=1))"
            )
        if predict not in _PREDICTIONS:
            raise ValueError(
                f"StepInBackward(predict={predict!r}): choose one of {_PREDICTIONS} (a local-"
                "gradient prediction is clipped by the norm of the whole estimate, known only "
                "when the backward ends)"
            )
        if clip is not None and not clip > 0:
            raise ValueError(f"StepInBackward(clip={clip!r}): a positive norm, or None")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"StepInBackward takes a torch.optim.Optimizer, got {optimizer!r}")
        self.model, self.optimizer, self.pipeline = model, optimizer, pipeline
        self.clip, self.predict, self.prefetch = clip, predict, prefetch
        self.units: list[_Unit] = []
        for hook, params in pipeline.entries:
            if hasattr(hook, "replicate"):
                raise ValueError(
                    "StepInBackward steps FSDP2's reduce-scatter groups; compressed HSDP's "
                    "all-reduce hooks are not supported: drop replicate= or StepInBackward"
                )
            module, gather = pipeline.owners[id(hook)]
            if prefetch and not isinstance(gather, (WeightDiffAllGather, QuantizedMasterAllGather)):
                raise ValueError(
                    f"StepInBackward(prefetch=True): FSDP module '{hook.module_name or '<root>'}' "
                    "has no gather that keeps what it gathered (weight differences or the "
                    "quantized master), so FSDP2 would drop the prefetch when the backward ends "
                    "and gather again: use such a recipe (sdp4bit, qwd-only), or prefetch=False"
                )
            self.units.append(_Unit(module, hook, params, gather))
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = {id(p) for p in model.parameters() if p.requires_grad}
        if stepped != mine or len(self._unit_of) != len(mine):
            raise ValueError(
                "StepInBackward needs the optimizer over exactly the model's trainable "
                "parameters, each in a staleness-1 FSDP group (other parameters would be "
                "stepped at the wrong time or never)"
            )
        self._order = [p for p in model.parameters() if p.requires_grad]
        self._group = _shard_group(self._order)
        self._stream = None
        self._task = -1
        self._active = False
        self._coef: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        """The last applied gradient's global norm before clipping (with ``clip``)."""
        self.late = 0
        """Module steps left to :meth:`finish` (a module whose parameters got no gradient)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in self._order]
        if pipeline.on_apply is not None:
            raise ValueError("this model already has a StepInBackward: remove() it first")
        pipeline.on_apply = self._prepare

    # --- in the backward ---------------------------------------------------------------------
    def _prepare(self) -> None:
        """Run by every staleness hook before it applies a result; acts on a backward's
        first: reads every result (NaN/Inf, norm) before the first is replaced."""
        task = _graph_task()
        if task == self._task:
            return
        if self._active:
            raise RuntimeError(
                "qsdp StepInBackward: a backward started before finish() was called after the "
                "last one; call sib.finish() after every backward"
            )
        self._task = task
        self.pipeline.checked = False
        results = [hook.delay.finish() for hook, _ in self.pipeline.entries]
        if all(r is None for r in results) or self.pipeline.synchronous:
            return  # nothing to apply: the plain loop's step (or none) after the backward
        if any(r is None for r in results):
            raise RuntimeError("qsdp StepInBackward: some groups have a result in flight, others not")
        for hook, _ in self.pipeline.entries:
            _check_avg(hook.delay, "StepInBackward needs it")
        self.pipeline.checked = True
        bad = self._check_nonfinite(results)
        if bad is not None:  # raised when the backward ends (FSDP2's own final callback first)
            torch.autograd.Variable._execution_engine.queue_callback(bad)
            return
        self._coef = self._clip_coefficient(results) if self.clip is not None else None
        for u in self.units:
            u.arrived.clear()
            u.stepped = False
        self._active = True

    def _check_nonfinite(self, results: list[torch.Tensor]) -> Callable[[], None] | None:
        """Every group's NaN/Inf flags, agreed over the shard group in one all-reduce and read
        once; the flagged groups' results are zeroed. Returns what raises the error on every
        rank (``"raise"``: no module steps in this backward), or None."""
        checked = [
            (hook, r) for (hook, _), r in zip(self.pipeline.entries, results) if hook.check
        ]
        if not checked:
            return None
        flags = [nonfinite_flags(r.reshape(1, -1), hook.layout) for hook, r in checked]
        joined = torch.cat(flags)
        checked[0][0].stats.add_bytes("nonfinite_check", joined.numel() * joined.element_size())
        dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=self._group)
        host = joined.tolist()
        where, offset = [], 0
        for (hook, result), f in zip(checked, flags):
            mine, offset = host[offset : offset + f.numel()], offset + f.numel()
            if not any(mine):
                continue
            hook.zeroed += 1
            result.zero_()  # (raise: its parameters do not move either)
            layout = hook.layout
            if layout is not None and len(layout) == len(mine):
                where += [layout[i][0] for i, bad in enumerate(mine) if bad]
            else:
                where.append(f"the parameters of FSDP module {hook.module_name or '<root>'}")
        if not where or checked[0][0].check.mode != "raise":
            return None
        message = (
            f"non-finite gradient (NaN/Inf, or too large to quantize) on at least one rank in "
            f"{', '.join(where)}, found before StepInBackward applied it (no parameter moved); "
            "fix the source (a diverging loss, a missing grad clip or loss scale), or build "
            "the config with nonfinite='zero' to zero them for the step (counted)"
        )

        def fail() -> None:
            raise ValueError(message)

        return fail

    def _clip_coefficient(self, results: list[torch.Tensor]) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient for the gradients the backward applies, from the
        results (each parameter's gradient as FSDP2 will write it: cast to its dtype)."""
        views: dict[int, torch.Tensor] = {}
        for (_, params), r in zip(self.pipeline.entries, results):
            for p, v in _by_param(r, params).items():
                views[id(p)] = like_param(v.to(p.dtype), p)
        total = torch.nn.utils.get_total_norm([views[id(p)] for p in self._order])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        self.norm = total
        return torch.clamp(self.clip / (total + 1e-6), max=1.0)

    def _arrived(self, p: nn.Parameter) -> None:
        """A parameter's post-accumulate-grad hook: FSDP2 wrote its sharded gradient."""
        if not self._active or _graph_task() != self._task:
            return
        unit = self._unit_of[id(p)]
        unit.arrived.add(id(p))
        if len(unit.arrived) == len(unit.params):
            self._step(unit)
            if self.prefetch:
                self._gather_ahead(unit)

    @torch.no_grad()
    def _step(self, unit: _Unit) -> None:
        """The module's update, as the plain loop's clip, prediction and step would make it."""
        grads = [local_of(p.grad) for p in unit.params if p.grad is not None]
        if self._coef is not None and grads:
            torch._foreach_mul_(grads, self._coef.to(grads[0].device))
        xs = [local_of(p.detach()) for p in unit.params]
        if unit.shifted:  # back from the prediction
            torch._foreach_sub_(xs, unit.update)
            unit.shifted = False
        if self.predict == "last":
            if unit.update is None:
                unit.update = [torch.empty_like(x) for x in xs]
            torch._foreach_copy_(unit.update, xs)
        self.optimizer.step()  # only this module's parameters have gradients
        if self.predict == "last":
            torch._foreach_sub_(unit.update, xs)
            torch._foreach_neg_(unit.update)
            torch._foreach_add_(xs, unit.update)
            unit.shifted = True
        for p in unit.params:
            p.grad = None
        unit.stepped = True

    def _gather_ahead(self, unit: _Unit) -> None:
        """Start the module's gather for the next step (see the note, point 3)."""
        unit.gather.for_next_step = True
        try:
            device = local_of(unit.params[0]).device
            if device.type != "cuda":
                unit.module.unshard(async_op=True)
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                unit.module.unshard(async_op=True)
        finally:
            unit.gather.for_next_step = False

    # --- after the backward ------------------------------------------------------------------
    def finish(self) -> torch.Tensor | bool | None:
        """After every backward: the update is done. Returns None when this backward did not
        step (nothing applied, or a ``synchronous()`` backward: step as the plain loop does),
        else the applied gradient's norm before clipping (with ``clip``) or True. A module
        whose parameters got no gradient in the backward is stepped here (counted in
        :attr:`late`)."""
        if not self._active:
            self._task = -1
            return None
        self._active = False
        self._task = -1
        self.pipeline.checked = False
        for unit in self.units:
            if not unit.stepped:
                self.late += 1
                self._step(unit)
        for p in self._order:
            p.grad = None
        return self.norm if self.clip is not None else True

    def settle(self) -> None:
        """Take the prediction back, so the parameters are the iterate (before a checkpoint,
        an evaluation, ``drain()`` or any step outside the backward). The next step computes
        at the parameters as they are; the prefetched gathers of weights that move again are
        sent again. Call on every rank."""
        with torch.no_grad():
            for unit in self.units:
                if unit.shifted:
                    torch._foreach_sub_([local_of(p.detach()) for p in unit.params], unit.update)
                    unit.shifted = False

    def remove(self) -> None:
        """Take the hooks off (after :meth:`settle`)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.pipeline.on_apply = None


def _shard_group(params: list[nn.Parameter]) -> dist.ProcessGroup:
    """The process group FSDP2 shards ``params`` over (one for all of them)."""
    meshes = [p.device_mesh for p in params if isinstance(p, DTensor)]
    if len(meshes) != len(params) or any(m.ndim != 1 for m in meshes):
        raise ValueError(
            "StepInBackward needs every parameter sharded by FSDP2 on a 1-D mesh (native HSDP's "
            "2-D meshes and unsharded parameters are not supported)"
        )
    groups = {m.get_group(0).group_name: m.get_group(0) for m in meshes}
    if len(groups) != 1:
        raise ValueError(
            f"StepInBackward needs every parameter sharded over one process group; found "
            f"{len(groups)}"
        )
    return next(iter(groups.values()))


def _graph_task() -> int:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if task is None else task()

