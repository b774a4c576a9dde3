"""Hugging Face: qsdp in the FSDP2 or DDP model that ``accelerate`` or the ``transformers``
``Trainer`` builds, in a few lines the user adds (``pip install 'qsdp[hf]'``).

[Note: where the adapter reaches the model]
Accelerate builds the data-parallel model in ``Accelerator.prepare``; the Trainer calls that
inside ``train()``, so its model exists only once training begins::

    model, opt = accelerator.prepare(model, opt)       trainer.train()
      FSDP2 plugin (fsdp_version=2): fully_shard         accelerator.prepare (a checkpoint
        per layer, then the root                           loaded, the optimizer made)
      DDP (MULTI_CPU, MULTI_GPU, ...):                   model.zero_grad()
        DistributedDataParallel(model)                   callbacks' on_train_begin  <- QSDPCallback
                    |                                    first forward
                    v                                         |
    hf.compress(accelerator, model, recipe)       trainer.model_wrapped
                    \\                                        /
            qsdp.compress_fsdp(root, ...)  or  qsdp.ddp.register(ddp, ...)

The Trainer hands its callbacks ``model=trainer.model``, which under DDP is the unwrapped model;
the DDP wrapper is the Trainer's documented ``model_wrapped`` ("always points to the most
external model"), so :class:`QSDPCallback` holds its Trainer. A ``torch.compile``-d model is
reached through the compiled wrapper (``_orig_mod``). Nothing here communicates: the
collectives, the NaN/Inf verdict, the checkpoint state and the agreement across ranks are the
two entry points' own. The checks below read only the launch configuration, which is the same
on every rank, so every rank raises the same error.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

# qsdp's public names only (tests/test_layering.py)
from .. import CompressionConfig, Schedule
from ._installed import Compressed, install

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, is_compiled_module
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(
        f"qsdp.integrations.hf needs transformers and accelerate ({e}); install them with "
        "pip install 'qsdp[hf]'"
    ) from e

__all__ = ["Compressed", "QSDPCallback", "compress", "compress_trainer"]

_FIX = (
    "use FSDP2 (Accelerate: FullyShardedDataParallelPlugin(fsdp_version=2); Trainer: "
    "fsdp=True, fsdp_config={'version': 2}) or DDP (launch several processes without a "
    "plugin)"
)


def compress(
    accelerator: Accelerator,
    model: nn.Module,
    config: CompressionConfig | str,
    *,
    schedule: Schedule | None = None,
    **options: Any,
) -> Compressed:
    """Compress the collectives of a model ``accelerator.prepare`` returned.

    Call it right after ``model, optimizer = accelerator.prepare(model, optimizer)`` and before
    the first forward, on every rank. FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``)
    goes to :func:`qsdp.compress_fsdp`, DDP to :func:`qsdp.ddp.register`.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model (FSDP2's root module or the DDP wrapper, compiled or not).
        config: a :class:`qsdp.CompressionConfig` or a recipe name; under DDP a gradient-only
            one (``"cgx"``, ``"qsdp-g8"``, ``"global-qsgd"``, ``"bf16"``, ``"auto"``).
        schedule: a :class:`qsdp.Schedule` (when and on which communicators), passed on.
        **options: passed on: ``mesh=``, ``replicate=`` to ``compress_fsdp``,
            ``error_feedback=`` to ``qsdp.ddp.register``.

    Returns:
        The :class:`Compressed` model and qsdp's state of it (its ``stats`` count the bytes).

    Raises:
        ValueError: DeepSpeed, FSDP1 (``fsdp_version=1``), one process (nothing to
            communicate), XLA or Megatron-LM, a model that is not the one ``prepare``
            returned; and whatever the entry point raises (a recipe that compresses weights
            under DDP, other arguments on another rank, ...).
    """
    target = _prepared(accelerator, model, where="qsdp.integrations.hf.compress")
    return install(target, config, schedule=schedule, options=options)


def compress_trainer(
    trainer: Trainer,
    config: CompressionConfig | str,
    *,
    schedule: Schedule | None = None,
    **options: Any,
) -> QSDPCallback:
    """Compress the collectives of the model a ``transformers.Trainer`` trains.

    Call it before ``trainer.train()``, on every rank. It adds a :class:`QSDPCallback`, which
    hands the model the Trainer prepared (FSDP2 through Accelerate's plugin with
    ``fsdp_config={'version': 2}``, or DDP) to :func:`qsdp.compress_fsdp` or
    :func:`qsdp.ddp.register` when training begins, and reads the last step's NaN/Inf verdict
    when it ends.

    Args:
        trainer: the ``transformers.Trainer`` (or a subclass).
        config, schedule, **options: as :func:`compress`.

    Returns:
        The callback; its ``compressed`` (None until training begins) holds the model and
        qsdp's state of it.

    Raises:
        ValueError: training has begun, the Trainer's setup is one :func:`compress` refuses
            (DeepSpeed, FSDP1, one process, XLA), or ``schedule.staleness`` is 1.
    """
    where = "qsdp.integrations.hf.compress_trainer"
    if trainer.is_in_train:
        raise ValueError(
            f"{where} was called while trainer.train() runs; its model is prepared and "
            "training: call it before trainer.train()"
        )
    _check_setup(trainer.accelerator, where=where)
    if schedule is not None and schedule.staleness:
        raise ValueError(
            f"{where}: schedule=Schedule(staleness={schedule.staleness}) needs a loop that skips "
            "optimizer.step() while state.applied_nothing and calls state.drain() after the "
            "last backward; the Trainer's loop does neither: use staleness=0 here, or "
            "hf.compress in your own Accelerate loop"
        )
    callback = QSDPCallback(trainer, config, schedule=schedule, **options)
    trainer.add_callback(callback)
    return callback


class QSDPCallback(TrainerCallback):
    """A ``TrainerCallback`` that installs qsdp on the Trainer's prepared model when training
    begins ([Note: where the adapter reaches the model]); made by :func:`compress_trainer`."""

    def __init__(
        self,
        trainer: Trainer,
        config: CompressionConfig | str,
        *,
        schedule: Schedule | None = None,
        **options: Any,
    ) -> None:
        self.trainer = trainer
        """The Trainer whose ``model_wrapped`` is compressed."""
        self.config = config
        self.schedule = schedule
        self.options = options
        self.compressed: Compressed | None = None
        """The model and qsdp's state of it, from ``on_train_begin`` on."""

    def on_train_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        where = "qsdp.integrations.hf.QSDPCallback"
        target = _prepared(self.trainer.accelerator, self.trainer.model_wrapped, where=where)
        if self.compressed is not None and self.compressed.model is target:
            return  # a second train() on the same prepared model: installed already
        self.compressed = install(target, self.config, schedule=self.schedule, options=self.options)

    def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        if self.compressed is None:  # on_train_begin passed by: added by a running train()
            raise ValueError(
                "qsdp.integrations.hf.QSDPCallback was added after training began, so the "
                "model was never compressed: call compress_trainer(trainer, ...) before "
                "trainer.train()"
            )

    def on_train_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        # the last backward's NaN/Inf verdict is otherwise read only by a next backward
        self.compressed.state.check_nonfinite()


def _check_setup(accelerator: Accelerator, *, where: str) -> None:
    """Refuse what qsdp cannot compress, naming the setting and the fix."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        version = accelerator.state.fsdp_plugin.fsdp_version
        if version != 2:
            raise ValueError(
                f"{where}: fsdp_version={version}; qsdp compresses FSDP2 (fully_shard), whose "
                "collectives take custom hooks, not FSDP1: set fsdp_version=2 "
                "(FullyShardedDataParallelPlugin(fsdp_version=2); Trainer: "
                "fsdp_config={'version': 2})"
            )
    elif kind == DistributedType.NO:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        hint = (
            f"; WORLD_SIZE={launched} says {launched} were launched: without GPUs Accelerate "
            "runs them as one unless told to use the CPU (Accelerator(cpu=True), or "
            "TrainingArguments(use_cpu=True))"
            if launched > 1
            else ""
        )
        raise ValueError(
            f"{where}: accelerator.distributed_type=NO (one process): nothing crosses a wire; "
            "launch two or more processes (accelerate launch --num_processes N, or torchrun "
            f"--nproc-per-node N){hint}"
        )
    elif not kind.name.startswith("MULTI_"):  # MULTI_CPU, MULTI_GPU, ...: DDP
        raise ValueError(
            f"{where}: accelerator.distributed_type={kind.value}: its collectives are not "
            f"torch.distributed's FSDP2 or DDP ones, which are all qsdp compresses; {_FIX}"
        )


def _prepared(accelerator: Accelerator, model: nn.Module, *, where: str) -> nn.Module:
    """The module ``accelerator.prepare`` made of ``model``: the FSDP2 root or DDP's wrapper."""
    _check_setup(accelerator, where=where)
    inner = model._orig_mod if is_compiled_module(model) else model
    if accelerator.distributed_type == DistributedType.FSDP:
        wanted, kind = FSDPModule, "an FSDP2 module (fully_shard)"
    else:
        wanted, kind = DistributedDataParallel, "a DistributedDataParallel module"
    if not isinstance(inner, wanted):
        raise ValueError(
            f"{where}: the model is a {type(inner).__name__}, not {kind}; pass the model "
            "accelerator.prepare(model, optimizer) returned (under DDP, Accelerate wraps only "
            "a model with trainable parameters)"
        )
    return inner
