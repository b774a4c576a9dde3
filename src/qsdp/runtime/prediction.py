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

**From each rank's own gradient** (``WeightPrediction(optimizer, local=comm_state)``, FSDP2's
reduce-scatter at staleness 1, Adam and AdamW): the update in flight is the optimizer's next step
with the gradient being reduced; its momentum part is known exactly, only the new gradient is not,
and each rank holds its own share of it (its row of the reduce-scatter's input, an unbiased
estimate of the average). Over SDP4Bit's two levels (``mesh=``) the reduce-scatter hands over each
rank's chunk averaged over its node once the intra-node level is summed (before the slow inter-node
level): that is the estimate, half the batch on 2 nodes of 2 instead of a quarter. Under compressed
HSDP only the replicate (inter-node) all-reduce is delayed, and the estimate is its input, the
node's average: each node predicts from its own, clipped by its norm over the node. Under DDP
(``local=hook``, the ``qsdp.ddp.register`` state) each rank keeps its own whole gradient of the
buckets in flight and predicts from it: the replicas compute at different points, and are identical
again once the backward restored them. The prediction is that step computed with the rank's own
gradient, clipped by the norm of one whole estimate (the world's shards under FSDP2, the node's
under HSDP, the rank's own under DDP: ``estimate_square_norm``), on each rank's own shards: the
all-gathers assemble it.
Measured by hand on GPT-125M (``benchmarks/staleness_reference.py``, variant ``local``): +6.0%
against the synchronous loss, where the last-update prediction gives +18.7% and the delay as is
+30.5%; the exact reduced gradient gives +0.4% (``oracle``). Through qsdp (``qsdp train``,
2x H100, each rank's estimate half the batch): +1.85% against +19.4% with the last update. The
shards are copied before the shift and restored after (ranks shift differently; a subtraction
would not restore them bit for bit). Memory: one shard per group kept by the hooks until the
prediction reads them, and one copy of the local parameters while they are moved; under FSDP2
the schedule predicts in the all-gathers instead, with no copy ([Note: the prediction in the
gathers] in ``qsdp.runtime.gathered``).

Predict only in a step whose backward applies a reduction in flight (the comm state's
``in_flight``): the first step, the synchronous step after the staleness gate fired and the
step after it apply nothing or have nothing in flight, so their gradients land where they were
computed. ``qsdp train --staleness 1`` predicts: ``--predict local`` (the default), ``last`` or
``none``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .adam_step import adam_next, check_adam, clip_coefficient
from .contracts import LocalGradients, StalenessState, check_contract
from .gathered import GatheredPrediction
from .placement import like_param, local_of

__all__ = ["AutoPrediction", "WeightPrediction", "predict_with"]


class WeightPrediction:
    """Moves the parameters of ``optimizer`` to a prediction of the next iterate for a step's
    forward and backward (:meth:`ahead`; see [Note: weight prediction]): the last update
    applied again, or, with ``local``, the optimizer's next step with each rank's own gradient.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (plain tensors, or
            FSDP2's sharded DTensors: each rank predicts its own shard); with ``local``,
            ``torch.optim.Adam`` or ``AdamW``.
        local: the comm state at staleness 1 (``qsdp.fsdp.comm_state(model)``, or the state
            ``qsdp.ddp.register`` returned): predict from each rank's own gradient of the step
            in flight, which its hooks then keep (``keep_local_gradients``,
            ``local_gradients``, ``estimate_square_norm``).

    A ``torch.distributed.checkpoint`` ``Stateful``: save it with the optimizer so a resumed
    run predicts as an uninterrupted one. :meth:`remove` takes the optimizer hooks off.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, local: LocalGradients | None = None
    ) -> None:
        self._build(optimizer, local=local, moves=None)

    def _build(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        local: LocalGradients | None,
        moves: set[int] | None,
        gathers: GatheredPrediction | None = None,
        gathered: frozenset[int] = frozenset(),
    ) -> None:
        """``moves``: the ids of the parameters this prediction may move (None: every one of
        the optimizer's), which it claims ([Note: one prediction per parameter]); of those,
        ``gathered`` are predicted in their all-gathers through ``gathers``, not moved
        ([Note: the prediction in the gathers] in ``qsdp.runtime.gathered``)."""
        self._gathers, self._gathered = gathers, gathered
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"WeightPrediction takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._claims = [p for p in self.params if moves is None or id(p) in moves]
        _check_unclaimed(self._claims)
        self.update: list[torch.Tensor] | None = None
        """The last update of each parameter's local tensor, or None before the first step."""
        self.local = local
        self._ahead = False
        if local is not None:
            check_contract(local, LocalGradients, what="WeightPrediction(local=...)")
            check_adam(optimizer)
            local.keep_local_gradients()
        # (with local, the pre-hook only refuses a step inside ahead())
        self._handles = [optimizer.register_step_pre_hook(self._before_step)]
        if local is None:
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
        _claim(self)

    def _locals(self) -> list[torch.Tensor]:
        return [local_of(p.detach()) for p in self.params]

    def _before_step(self, *_: object) -> None:
        if self._ahead:
            raise RuntimeError(
                "optimizer.step() inside WeightPrediction.ahead(): the parameters are the "
                "predicted ones; step after the block (after the backward)"
            )
        if self.local is not None:
            return
        xs = self._locals()
        if self.update is None:
            self.update = [torch.empty_like(x) for x in xs]
        torch._foreach_copy_(self.update, xs)

    def _after_step(self, *_: object) -> None:
        # update = x_after - x_before, in place of the copy
        torch._foreach_sub_(self.update, self._locals())
        torch._foreach_neg_(self.update)

    @contextlib.contextmanager
    def ahead(self, *, enabled: bool = True, clip: float | None = None) -> Iterator[None]:
        """Within: the parameters are the prediction (``x + u``, ``u`` the last update; with
        ``local``: the optimizer's next step with the ranks' own gradients, clipped as
        ``clip_grad_norm_(max_norm=clip)`` would clip one whole estimate, its norm from the comm
        state's ``estimate_square_norm``); run the step's forward and backward here.
        ``enabled=False``, or with nothing to predict from yet: the parameters as they are. Call
        on every rank."""
        if self._ahead:
            raise RuntimeError("WeightPrediction.ahead() is not reentrant")
        if self.local is not None:
            with self._ahead_local(enabled=enabled, clip=clip):
                yield
            return
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

    @contextlib.contextmanager
    def _ahead_local(self, *, enabled: bool, clip: float | None) -> Iterator[None]:
        # taken: read once here, not held through the forward ([Note: estimates handed over])
        estimates = self.local.local_gradients(take=True) if enabled else {}
        coef: float | torch.Tensor = 1.0
        if estimates and clip is not None:  # (in flight on every rank or on none)
            square = self.local.estimate_square_norm(estimates)  # of one whole estimate
            # on the device, never read by the host ([Note: a clipped prediction never reads
            # the device] in qsdp.runtime.adam_step)
            coef = clip_coefficient(square, clip)
        armed = False
        if self._gathers is not None and estimates:  # predicted where they are gathered
            on_gathers = {p: e for p, e in estimates.items() if id(p) in self._gathered}
            if on_gathers:
                self._gathers.arm(self.optimizer, on_gathers, coef)
                armed = True
            estimates = {p: e for p, e in estimates.items() if id(p) not in self._gathered}
            del on_gathers
        saved = adam_next(self.optimizer, estimates, coef) if estimates else []
        del estimates  # (this generator's frame lives through the block)
        self._ahead = True
        try:
            yield
        finally:
            self._ahead = False
            if armed:
                self._gathers.disarm(self.optimizer)
            if saved:  # one launch per parameter list, not one copy per parameter
                with torch.no_grad():
                    torch._foreach_copy_([x for x, _ in saved], [c for _, c in saved])

    def remove(self) -> None:
        """Take the hooks off the optimizer; the prediction stops tracking its steps (and its
        parameters may get another prediction)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        _forget(self._claim_ref)

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The last update of each parameter, shaped and placed as the parameter (a DTensor
        for FSDP2's sharded ones), under ``update.<i>``; ``has_update`` says whether any step
        was taken."""
        if self.local is not None:  # the estimates are the comm state's, saved with it
            return {"local": torch.tensor([1])}
        has = int(self.update is not None)
        state: dict[str, torch.Tensor] = {"has_update": torch.tensor([has])}
        for i, p in enumerate(self.params):
            local = self.update[i] if self.update is not None else torch.zeros_like(local_of(p))
            state[f"update.{i}"] = like_param(local.clone(), p)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.local is not None or "local" in state:
            if (self.local is not None) != ("local" in state):
                raise ValueError(
                    "this weight-prediction state and this WeightPrediction predict from "
                    "different sources (local gradients or the last update)"
                )
            return
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


# [Note: one prediction per parameter]
# Two predictions over the same parameters would each move them in ahead(): the forward and
# backward would run at x + 2u (or Adam's next step taken twice) and no error would say so.
# That is what a loop predicting by hand beside Schedule(staleness=1), whose default
# predict="local" predicts on hooks, did (benchmarks/bench_fsdp_step.py did, from 2026-11-28
# until this check found it). A WeightPrediction claims its parameters when it is built and
# frees them in remove(); a second claim raises, on every rank alike (ranks build the same
# predictions): built by hand next to the schedule's, at the schedule's first
# optimizer.step(); built by hand after it, at once. A hand-made prediction claims all its
# optimizer's parameters, the schedule's only its model's (two models at staleness 1 may share
# one optimizer: each moves its own). The table maps each claimed parameter's
# id to a weak reference of its prediction, which holds the parameter (so the id is not
# reused while the claim is alive) and leaves with its optimizer, whose hooks hold it.
_moved_by: dict[int, weakref.ref[WeightPrediction]] = {}


def _check_unclaimed(params: list[torch.Tensor]) -> None:
    """Raise if a live prediction already moves one of ``params``."""
    for p in params:
        ref = _moved_by.get(id(p))
        if ref is not None and ref() is not None:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} is already moved by another "
                "WeightPrediction (each step would move it twice). Keep one: a loop that "
                "predicts by hand builds its schedule with Schedule(staleness=1, "
                "predict='none'); with the schedule's default predict='local' drop the "
                "hand-made WeightPrediction; or remove() the old prediction first"
            )


def _claim(prediction: WeightPrediction) -> None:
    prediction._claim_ref = ref = weakref.ref(prediction, _forget)
    for p in prediction._claims:
        _moved_by[id(p)] = ref


def _forget(ref: weakref.ref) -> None:
    """Free what the prediction of ``ref`` claimed (its ``remove()``, or its collection)."""
    for key in [k for k, v in _moved_by.items() if v is ref]:
        del _moved_by[key]


class AutoPrediction:
    """``Schedule(staleness=1)`` (its default ``predict="local"``): :class:`WeightPrediction`
    from each rank's own gradient with no change to the training loop.

    [Note: prediction in the schedule]
    The loop of the README computes each delayed step's gradient ahead by hand: a
    ``WeightPrediction(optimizer, local=state)`` and its ``ahead(enabled=state.in_flight)``
    around the forward and backward. Installed by the schedule, the same happens on hooks:
    the first ``optimizer.step()`` of an optimizer holding the model's parameters (a global
    optimizer pre-hook, [Note: one global optimizer hook]) attaches a
    :class:`WeightPrediction` to it; the model's forward pre-hook (ahead of FSDP2's, so the
    all-gathers read the moved shards) enters ``ahead`` in training mode with grad enabled
    while a reduction is in flight (never for an evaluation); the next ``optimizer.step()``
    (the global pre-hook runs before the optimizer's own) or ``drain()`` puts the parameters
    back. So every forward and backward of one
    optimizer step (gradient accumulation included) runs at the predicted point and the step
    applies to the parameters as they were, the bits of the loop by hand. Under FSDP2 the
    groups whose all-gather is qsdp's are predicted in it and never moved ([Note: the
    prediction in the gathers] in ``qsdp.runtime.gathered``: the same gathered bits, no copy
    of the shards); any other parameter is moved, and between a backward and its
    ``optimizer.step()`` reads as the predicted one: read parameters after the step. The
    estimates are kept from the first backward (``keep_local_gradients`` at
    installation); Adam's state is empty before the first step, so the first prediction is at
    the forward after it, as by hand. Adam and AdamW only (the error comes from that first
    step on every rank, naming ``predict="none"``); a hand-made ``WeightPrediction`` beside it
    would move the parameters twice: a loop that predicts by hand (``qsdp train``) builds its
    schedule with ``predict="none"``. The default since 2026-11-28: the delay as it is cost
    +19-30% of final loss on GPT-125M, this prediction +0.6-1.9% (docs/recipes.md).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        local: LocalGradients,
        *,
        clip: float | None,
        gathers: GatheredPrediction | None = None,
        gathered: frozenset[int] = frozenset(),
    ) -> None:
        """``gathers``, ``gathered``: the ids of the parameters whose all-gathers predict them
        instead ([Note: the prediction in the gathers] in ``qsdp.runtime.gathered``)."""
        check_contract(local, StalenessState, what="Schedule(predict='local')")
        self.local = local
        self.clip = clip
        self._gathers, self._gathered = gathers, gathered
        self.loaded = False
        """A checkpoint's reduction in flight was loaded and no optimizer is known yet."""
        self.predictions: list[WeightPrediction] = []
        self._module = weakref.ref(module)  # (the global hook must not keep the model alive)
        self._owned = {id(p) for p in module.parameters()}
        self._stack: contextlib.ExitStack | None = None
        local.keep_local_gradients()
        self._handles = [module.register_forward_pre_hook(self._before_forward, prepend=True)]
        _live.add(self)
        _dispatch_steps()

    @property
    def ahead(self) -> bool:
        """Whether this step computes at the predicted point now (moved parameters, or the
        weights the gathers send: [Note: the prediction in the gathers])."""
        return self._stack is not None

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._stack is not None:
            return
        if not module.training or not torch.is_grad_enabled():  # (an evaluation)
            return
        if not self.local.in_flight:
            return
        if not self.predictions:
            if self.loaded:  # [Note: a resumed prediction]
                raise RuntimeError(
                    "qsdp staleness 1: a checkpoint's reduction in flight was loaded, but the "
                    "schedule's prediction does not know the optimizer yet (it learns it at the "
                    "first optimizer.step(), after this forward): the resumed step would not be "
                    "predicted as the saved run's was. After loading, call "
                    "state.predict_with(optimizer) (state: qsdp.fsdp.comm_state(model), or what "
                    "qsdp.ddp.register returned), or build the schedule with predict='none'"
                )
            return
        if isinstance(module, FSDPModule):
            # FSDP2 keeps the root gathered after a forward with no backward (an evaluation):
            # this forward would compute on those weights, gathered unpredicted, as they are
            module.reshard()
        stack = contextlib.ExitStack()
        for prediction in self.predictions:
            stack.enter_context(prediction.ahead(enabled=True, clip=self.clip))
        self._stack = stack

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if self._module() is None:  # the model is gone (its parameters' ids may be reused)
            self.remove()
            return
        self.restore()
        self.attach(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._gathers is not None:  # [Note: the next step's weights in this backward]
            self._gathers.step_taken(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Predict ``optimizer``'s next step for the model's parameters it holds (once per
        optimizer; one holding none of them is ignored). The first ``optimizer.step()`` calls
        it; after loading a checkpoint, call it first ([Note: a resumed prediction])."""
        self.loaded = False
        if any(p.optimizer is optimizer for p in self.predictions):
            return
        if not any(id(p) in self._owned for g in optimizer.param_groups for p in g["params"]):
            return
        try:  # (it claims this model's parameters only: another model may share the optimizer)
            prediction = WeightPrediction.__new__(WeightPrediction)
            prediction._build(
                optimizer,
                local=self.local,
                moves=self._owned,
                gathers=self._gathers,
                gathered=self._gathered,
            )
            self.predictions.append(prediction)
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"Schedule(predict='local') predicts {type(optimizer).__name__}'s next step and "
                f"cannot: {e}. Build the schedule with predict='none'"
            ) from e

    # [Note: a resumed prediction]
    # The schedule learns the optimizer at its first ``optimizer.step()`` (a global pre-hook:
    # it is given none). A fresh run's first forwards have nothing to predict (no reduction in
    # flight, then no Adam state), but a run resumed from a checkpoint with a reduction in
    # flight predicted in the saved run's next step: resumed, its first step ran unpredicted,
    # and the run left the saved one's path silently (found 2026-11-28: the README's loop
    # resumed at step 3 of 6 ended on other parameters than the uninterrupted run). Loading a
    # reduction in flight (``load_state_dict`` of the comm state) now sets ``loaded``; the
    # first training forward refuses to run unpredicted until ``state.predict_with(opt)``
    # names the optimizer (then it continues bit for bit, tested for FSDP2 and DDP).

    def restore(self) -> None:
        """End the step's prediction (before a step, a drain): moved parameters put back, the
        gathers disarmed."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def remove(self) -> None:
        """Take every hook off (the parameters put back first)."""
        self.restore()
        _live.discard(self)
        for h in self._handles:
            h.remove()
        for p in self.predictions:
            p.remove()
        self._handles, self.predictions = [], []


def predict_with(
    predict: AutoPrediction | None, optimizer: torch.optim.Optimizer, *, what: str
) -> None:
    """A staleness-1 state's ``predict_with(optimizer)``: ``predict`` (its schedule's
    prediction, None if it has none) predicts ``optimizer``'s next step from now on; call it
    after loading a checkpoint ([Note: a resumed prediction]). ``what``: the state, for the
    error.

    Raises:
        ValueError: the schedule does not predict (staleness 0, or ``predict`` other than
            ``"local"``)."""
    if predict is None:
        raise ValueError(
            "predict_with() is for Schedule(staleness=1) with its prediction (predict='local', "
            f"the default); this {what}'s schedule does not predict"
        )
    predict.attach(optimizer)


# [Note: one global optimizer hook]
# Every AutoPrediction learns of the optimizer steps through one global optimizer pre-hook (and
# one post-hook) of the process, registered at the first and never taken off, which call the
# live instances (a WeakSet: the model's forward pre-hook holds each alive, so it leaves with
# its model). A hook of its own per instance, taken off by the instance from inside its call
# once its model was gone, mutated torch's ordered dict of global hooks while
# ``Optimizer.step`` iterated it: "OrderedDict mutated during iteration" at the next step of
# any optimizer, as soon as a second hook followed it (found on 2x H200,
# benchmarks/bench_ddp_step.py, whose rounds build one staleness-1 model after another; torch
# 2.11 and 2.13 alike).
_live: weakref.WeakSet[AutoPrediction] = weakref.WeakSet()
_dispatcher: object | None = None


def _on_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
    for auto in list(_live):  # (a copy: an instance may leave during its call)
        auto._before_step(optimizer)


def _on_step_done(optimizer: torch.optim.Optimizer, *_: object) -> None:
    for auto in list(_live):
        auto._after_step(optimizer)


def _dispatch_steps() -> None:
    """Register the process's one global optimizer pre-hook and post-hook, once."""
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = (
            register_optimizer_step_pre_hook(_on_step),
            register_optimizer_step_post_hook(_on_step_done),
        )
