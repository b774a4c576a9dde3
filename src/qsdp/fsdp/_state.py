"""What ``compress_fsdp`` installed on a model, and its checkpointable state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommStats
from ..config import CompressionConfig, Schedule, check_saved, config_record
from ..policy import auto
from ..runtime import NonfiniteCheck
from ..runtime.adam_step import square_norm
from ..runtime.delayed import DelayedReductions
from ..runtime.prediction import AutoPrediction, predict_with
from ..runtime.widths import WidthController
from ._gathers import WeightDiffAllGather
from ._hooks import StepClock

__all__ = ["CommState", "comm_state", "fsdp_comm_stats", "resync"]


@dataclass(kw_only=True)
class _Installed:
    config: CompressionConfig
    schedule: Schedule
    stats: CommStats
    clock: StepClock | None
    gathers: list[WeightDiffAllGather]
    hooks: list[object]
    """Every installed all-gather and reduce-scatter, in installation order."""
    slots: list[tuple[int, int]]
    """Each hook's place: (FSDP group, 0 for its all-gather or 1 for its reduction)."""
    groups: int
    """The model's FSDP groups (a checkpoint's counters have a row for each, whatever the
    recipe, so that another recipe's state loads far enough to say so)."""
    stale: DelayedReductions | None = None
    """Staleness 1: the reductions in flight."""
    widths: WidthController | None = None
    """Adaptive widths: each reduction group's width."""
    decision: auto.AutoDecision | None = None
    """``"auto"``: what was measured, predicted and chosen."""
    check: NonfiniteCheck | None = None
    """The NaN/Inf check of the model's reductions (None: ``nonfinite="propagate"``)."""
    predict: AutoPrediction | None = None
    """``Schedule(predict="local")``: the prediction on hooks."""
    replayed: tuple[str, ...] = ()
    """``Schedule(graphs=True)``: the FSDP modules whose collectives replay."""


# [Note: the installation lives on the model]
# A model's installation (its hooks, NaN/Inf check, staleness state, prediction) is kept in the
# model's own ``__dict__``, as torch's composable APIs keep FSDP2's state, not in a
# ``WeakKeyDictionary`` keyed by the model. Its objects form cycles (a hook holds the check, the
# check's last verdict holds the hooks and their parameters); held as a weak dictionary's value
# they outlived the model's own collection: the dictionary dropped the value in the collection
# that freed the model, and the cycles it had kept became garbage only for the next one. A model
# dropped with ``del model; gc.collect()`` kept its parameters (at staleness 1 its optimizer
# too) until a later collection (on gloo: tests/fsdp/test_release.py failed), and the next model
# of the process could be built beside them. (Found while the 1.42 B GPT's benchmark began
# variants with up to 14 GiB of earlier ones allocated on 4x H200; those were the benchmark's
# own, a collection made before its run returned: session 39, ``bench_fsdp_step._release``.)
# On the model, the installation is part of the model's cycle and goes in the same collection.
_KEY = "_qsdp_installed"


def _install(model: nn.Module, installed: _Installed) -> None:
    model.__dict__[_KEY] = installed


def _installed(model: nn.Module) -> _Installed:
    installed = model.__dict__.get(_KEY)
    if installed is None:
        raise ValueError("this model was not passed to qsdp.compress_fsdp")
    return installed


def fsdp_comm_stats(model: nn.Module) -> CommStats:
    """The byte counter of the collectives :func:`compress_fsdp` installed on ``model``.

    It counts, by the convention of ``qsdp.comm._stats`` ([Note: one convention for bytes]),
    every collective qsdp runs for the model (side channels included) and FSDP2's own HSDP
    replicate all-reduce. A collective the recipe leaves uncompressed (the weights of
    ``"global-qsgd"``, everything of ``"bf16"``) runs FSDP2's own implementation, untouched and
    not counted here; ``qsdp train`` adds its bytes by the same convention.
    """
    return _installed(model).stats


def resync(model: nn.Module) -> None:
    """Make the next all-gather of every weight-difference group send full precision.

    ``load_state_dict`` (and ``torch.distributed.checkpoint`` loads, which call it) does this by
    itself. Call it on every rank.
    """
    clock = _installed(model).clock
    if clock is None:
        raise ValueError("this model's recipe has no weight differences to resync")
    clock.request_resync()


class CommState:
    """The state of a model's compressed collectives, as a ``torch.distributed.checkpoint``
    ``Stateful``: the noise counters of every hook and the step clock.

    Save it beside the model and optimizer, e.g.
    ``dcp.save({"model": ..., "optim": ..., "qsdp": qsdp.fsdp.comm_state(model)}, ...)``, and
    load it the same way: the resumed run then draws the same stochastic-rounding noise as an
    uninterrupted one. Weight-difference reconstructions are not saved; loading makes their next
    gather full precision (as loading the model's state dict does).
    """

    def __init__(self, installed: _Installed) -> None:
        self._installed = installed

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state to save; reads the last backward's NaN/Inf verdict first
        (:meth:`check_nonfinite`: a checkpoint of a run whose last step was not finite raises
        on every rank under ``nonfinite="raise"``, and no verdict is left unread in it)."""
        self.check_nonfinite()
        inst = self._installed
        clock = inst.clock
        calls = torch.zeros(inst.groups, 2, dtype=torch.int64)
        for hook, (group, column) in zip(inst.hooks, inst.slots, strict=True):
            calls[group, column] = hook._steps.calls
        state = {
            "recipe": config_record(inst.config, inst.schedule),
            # "auto"'s record (all zeros for a named recipe), checked on load
            "auto": auto.state_entry(inst.decision),
            "calls": calls,
            "clock": torch.tensor(
                [clock.epoch, clock.generation] if clock else [0, 0], dtype=torch.int64
            ),
        }
        if inst.stale is not None:  # the reductions in flight, saved with the checkpoint
            state.update(inst.stale.state_dict())
        if inst.widths is not None:  # the adaptive widths, by module index
            state.update(inst.widths.state_dict())
        return state

    @property
    def config(self) -> CompressionConfig:
        """The config the model's collectives run (for ``"auto"``: the recipe it chose)."""
        return self._installed.config

    @property
    def schedule(self) -> Schedule:
        """When and on which communicators they run (for ``"auto"``: ``pipeline`` as it
        decided)."""
        return self._installed.schedule

    @property
    def decision(self) -> auto.AutoDecision | None:
        """``compress_fsdp(model, "auto")``: what it measured, predicted and chose
        (:class:`qsdp.policy.AutoDecision`; None for a named recipe). :meth:`state_dict` keeps
        its record, and loading a state whose decision chose otherwise raises."""
        return self._installed.decision

    @property
    def zeroed(self) -> int:
        """Gradient reductions zeroed for NaN/Inf so far, as read (``nonfinite="zero"``, or
        ``"raise"`` before it raised): each backward's count when the next one ends, or at
        :meth:`check_nonfinite`. The DDP hook's ``zeroed`` counts the same per bucket."""
        return sum(getattr(h, "zeroed", 0) for h in self._installed.hooks)

    @property
    def replayed(self) -> tuple[str, ...]:
        """The FSDP modules (their names in the model, ``""`` the root) whose collectives
        ``Schedule(graphs=True)`` replays from CUDA graphs: those whose shapes another module
        shares ([Note: only repeated shapes replayed] in ``qsdp.fsdp.api``); the others run
        eagerly. Empty without graphs."""
        return self._installed.replayed

    @property
    def widths(self) -> WidthController | None:
        """Adaptive widths (``CompressionConfig.adaptive``): each reduction group's width and
        the last plan (``.plan``: bytes and error against the uniform width), or None."""
        return self._installed.widths

    def check_nonfinite(self) -> None:
        """Read the NaN/Inf verdict of the last backward now (it is otherwise read when the
        next backward ends: [Note: the verdict read one backward later]): call on every rank
        after the last step, and before a checkpoint to save only runs that were finite. A
        no-op with ``nonfinite="propagate"`` or nothing unread.

        Raises:
            ValueError: with ``nonfinite="raise"``, a gradient of that backward held NaN/Inf
                (on every rank; its groups' gradients were zeroed on the device then).
        """
        if self._installed.check is not None:
            self._installed.check.flush()

    def predict_with(self, optimizer: torch.optim.Optimizer) -> None:
        """Staleness 1 as shipped: predict ``optimizer``'s next step from now on. Call it after
        loading a checkpoint, whose first forward refuses to run unpredicted otherwise
        (:func:`qsdp.runtime.prediction.predict_with`)."""
        predict_with(self._installed.predict, optimizer, what="model")

    def drain(self) -> None:
        """Staleness 1, after the last backward: put the reductions still in flight into the
        parameters' ``.grad``, for one more ``optimizer.step()`` (see [Note: one staleness
        core] in ``qsdp.runtime.delayed``). Call on every rank. Reads the last backward's
        NaN/Inf verdict first (:meth:`check_nonfinite`).

        Raises:
            ValueError: the model's config is synchronous, or a gradient of the last backward
                or a drained one holds NaN/Inf with ``nonfinite="raise"`` (on every rank).
        """
        if self._installed.stale is None:
            raise ValueError(
                "drain() is for staleness=1; a synchronous model has nothing in flight"
            )
        if self._installed.predict is not None:  # the parameters as they are, not predicted
            self._installed.predict.restore()
        self.check_nonfinite()
        self._installed.stale.drain()

    @contextlib.contextmanager
    def synchronous(self) -> Iterator[None]:
        """Staleness 1: the backwards inside reduce and apply their gradients at once, as at
        staleness 0 (the step after the staleness gate fired; drain first). The step after
        such a backward applies nothing."""
        stale = self._installed.stale
        if stale is None:
            raise ValueError("synchronous() is for staleness=1; this model is synchronous already")
        stale.synchronous = True
        try:
            yield
        finally:
            stale.synchronous = False

    @property
    def applied_nothing(self) -> bool:
        """Staleness 1: the last backward applied no reduction (the first step, or the first
        after :meth:`drain`): skip its ``optimizer.step()``. Always False at staleness 0."""
        stale = self._installed.stale
        return stale is not None and stale.applied_nothing

    def keep_local_gradients(self) -> None:
        """Staleness 1: keep each rank's own (unreduced) gradient of its shards while their
        reduction is in flight, for ``WeightPrediction(optimizer, local=state)`` (under
        compressed HSDP and over two levels the node's average). Memory: one
        shard per group."""
        if self._installed.stale is None:
            raise ValueError("local gradient estimates are for staleness=1")
        self._installed.stale.keep_local_gradients()

    def estimate_square_norm(self, estimates: dict) -> torch.Tensor:
        """The squared norm of one whole estimate, from this rank's :meth:`local_gradients`:
        the sum over the ranks whose shards make it (the world; the node under compressed
        HSDP, where each node has its own). A collective over that group."""
        if self._installed.stale is None:
            raise ValueError("local gradient estimates are for staleness=1")
        square = square_norm(estimates.values())
        dist.all_reduce(square, group=self._estimate_group())
        return square

    def _estimate_group(self) -> dist.ProcessGroup | None:
        """Where the local estimates together make one estimate of the whole gradient: the
        node (the shard group) under compressed HSDP, each node having its own; else the
        world (None), whose ranks each hold one shard of it."""
        groups = {id(h.shard): h.shard for h in self._installed.hooks if hasattr(h, "replicate")}
        if len(groups) > 1:
            raise ValueError("local gradient estimates: the HSDP hooks shard over different groups")
        return next(iter(groups.values()), None)

    def local_gradients(self, *, take: bool = False) -> dict:
        """Each parameter's share of this rank's own gradient of the step in flight (see
        :meth:`keep_local_gradients`). ``take``: handed over, the state keeps them no longer
        ([Note: estimates handed over] in ``qsdp.runtime.delayed``)."""
        if self._installed.stale is None:
            raise ValueError("local gradient estimates are for staleness=1")
        return self._installed.stale.local_gradients(take=take)

    @property
    def in_flight(self) -> bool:
        """Staleness 1: a reduction is in flight, to be applied by the next backward (whose
        gradient :class:`qsdp.runtime.WeightPrediction` may then compute ahead)."""
        stale = self._installed.stale
        return stale is not None and stale.in_flight

    @property
    def delayed_since(self) -> int | None:
        """Staleness 1: the synchronous backwards before the delayed schedule started, None
        while it has not (``Schedule.start``; [Note: when staleness 1 starts] in
        ``qsdp.runtime.stale_start``). None at staleness 0."""
        stale = self._installed.stale
        return None if stale is None else stale.start.started_at

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        inst = self._installed
        if "recipe" in state:
            check_saved(
                state["recipe"],
                inst.config,
                inst.schedule,
                what="qsdp.fsdp.CommState.load_state_dict",
            )
        auto.check_state_entry(state.get("auto"), decision=inst.decision, config=inst.config)
        calls = state["calls"]
        if tuple(calls.shape) != (inst.groups, 2):
            raise ValueError(
                f"this qsdp state counts {tuple(calls.shape)[0]} FSDP groups, the model has "
                f"{inst.groups}: it was saved from another model"
            )
        for hook, (group, column) in zip(inst.hooks, inst.slots, strict=True):
            hook._steps.calls = int(calls[group, column])
        if inst.clock is not None:
            inst.clock.epoch = int(state["clock"][0])
            inst.clock.request_resync()
        if inst.stale is not None:
            inst.stale.load_state_dict(state)
            if inst.predict is not None and inst.stale.in_flight:  # [Note: a resumed prediction]
                inst.predict.loaded = True
        if inst.widths is not None:
            inst.widths.load_state_dict(state)


def comm_state(model: nn.Module) -> CommState:
    """The checkpointable state of the collectives :func:`compress_fsdp` installed on ``model``."""
    return CommState(_installed(model))
