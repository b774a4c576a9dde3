"""Lightning: qsdp in the DDP or FSDP2 model a ``lightning.pytorch.Trainer`` builds, as one
callback the user adds (``pip install 'qsdp[lightning]'``).

[Note: where the callback reaches the model]
``trainer.fit(module)`` builds the data-parallel model itself; the callback runs at the first
hook that sees it final, before the first forward::

    strategy.setup_environment()   the process group (one already made is reused)
    callbacks' setup("fit")        <- QSDPCallback refuses what qsdp cannot compress
    module.configure_model()       ModelParallelStrategy: the user's fully_shard calls
    strategy.setup(trainer)        DDPStrategy: DistributedDataParallel(module);
                                   ModelParallelStrategy: meta weights materialised and moved;
                                   then the optimizers are made
    callbacks' on_fit_start        <- QSDPCallback: trainer.strategy.model is
                                        the DDP wrapper      -> qsdp.ddp.register
                                        the module, whose
                                        FSDP2 root it finds  -> qsdp.compress_fsdp
    a checkpoint restored, the sanity check, the loop
    callbacks' on_fit_end          <- the last backward's NaN/Inf verdict

Why not ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)``, Lightning's own way to a DDP
comm hook: Lightning registers that hook only when the device is CUDA (on CPU it is dropped
without a word), and it takes a ``(state, bucket)`` function with a state made before the DDP
wrapper exists, while ``qsdp.ddp.register`` builds its state from the wrapper (its process
group, parameter names, bucket size, a second communicator, the agreement of every rank's
arguments) and, for an uncompressed recipe, counts DDP's own all-reduce without a hook.

Why not ``qsdp.compress_fsdp`` inside ``configure_model``: there the model is not final yet
(Lightning materialises meta-device weights and moves the module afterwards, which qsdp does
not test), and one callback serves both strategies with the same checks.

Nothing here communicates: the collectives, the NaN/Inf verdict, the checkpoint state and the
agreement across ranks are the two entry points' own. The checks read only the Trainer's
configuration, the same on every rank, so every rank raises the same error.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

# qsdp's public names only (tests/test_layering.py)
from .. import CompressionConfig, Schedule
from ._installed import Compressed, install

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
        XLAStrategy,
    )
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(
        f"qsdp.integrations.lightning needs lightning ({e}); install it with "
        "pip install 'qsdp[lightning]'"
    ) from e

__all__ = ["Compressed", "QSDPCallback"]

_WHERE = "qsdp.integrations.lightning.QSDPCallback"
_FIX = (
    "use DDPStrategy() (DDP) or ModelParallelStrategy(data_parallel_size=N, "
    "tensor_parallel_size=1) with fully_shard in LightningModule.configure_model (FSDP2)"
)


class QSDPCallback(pl.Callback):
    """A Lightning ``Callback`` that compresses the collectives of the model the Trainer
    builds ([Note: where the callback reaches the model]).

    ``Trainer(..., callbacks=[QSDPCallback(recipe)])``, on every rank. Under ``DDPStrategy``
    the DDP wrapper goes to :func:`qsdp.ddp.register`; under ``ModelParallelStrategy`` the
    FSDP2 root module that ``configure_model`` built with ``fully_shard`` (the one module
    whose ``fully_shard`` encloses every other) goes to :func:`qsdp.compress_fsdp`.

    Args:
        config: a :class:`qsdp.CompressionConfig` or a recipe name; under DDP a gradient-only
            one (``"cgx"``, ``"qsdp-g8"``, ``"global-qsgd"``, ``"bf16"``, ``"auto"``).
        schedule: a :class:`qsdp.Schedule`, passed on; not ``staleness=1`` (refused: Lightning's
            loop steps the optimizer every batch and has no place to drain).
        **options: passed on: ``mesh=``, ``replicate=`` to ``compress_fsdp``,
            ``error_feedback=`` to ``qsdp.ddp.register``.

    Raises:
        ValueError: ``schedule.staleness`` is 1 (here); when fitting begins, on every rank: a
            strategy qsdp cannot compress (``FSDPStrategy``, which is FSDP1, DeepSpeed, XLA,
            one device or one process), no ``fully_shard`` in the module, or several FSDP2
            roots; and whatever the entry point raises (a recipe that compresses weights under
            DDP, other arguments on another rank, ...).
    """

    def __init__(
        self,
        config: CompressionConfig | str,
        *,
        schedule: Schedule | None = None,
        **options: Any,
    ) -> None:
        if schedule is not None and schedule.staleness:
            raise ValueError(
                f"{_WHERE}: schedule=Schedule(staleness={schedule.staleness}) needs a loop that "
                "skips optimizer.step() while state.applied_nothing and calls state.drain() "
                "after the last backward; Lightning's loop steps the optimizer every batch and "
                "drains nothing: use staleness=0 here, or qsdp.compress_fsdp / "
                "qsdp.ddp.register in your own loop"
            )
        self.config = config
        self.schedule = schedule
        self.options = options
        self.compressed: Compressed | None = None
        """The model and qsdp's state of it, from ``on_fit_start`` on (in the process that
        fits: with ``DDPStrategy(start_method="spawn")`` the spawned ones)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # before configure_model: refuse early, every rank alike
            _check_strategy(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = _target(trainer)
        if self.compressed is not None and self.compressed.model is target:
            return  # a second fit() on the same FSDP2 modules: installed already
        self.compressed = install(target, self.config, schedule=self.schedule, options=self.options)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last backward's NaN/Inf verdict is otherwise read only by a next backward
        if self.compressed is not None:
            self.compressed.state.check_nonfinite()


def _check_strategy(trainer: pl.Trainer) -> None:
    """Refuse what qsdp cannot compress, naming the setting and the fix."""
    strategy = trainer.strategy
    name = type(strategy).__name__
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            f"{_WHERE}: strategy={name} is FSDP1 (FullyShardedDataParallel), whose collectives "
            "take no custom hooks; qsdp compresses FSDP2: use ModelParallelStrategy("
            "data_parallel_size=N, tensor_parallel_size=1) and fully_shard in "
            "LightningModule.configure_model"
        )
    if isinstance(strategy, SingleDeviceStrategy):  # (its XLA subclass too)
        raise ValueError(
            f"{_WHERE}: strategy={name}: one device, nothing crosses a wire; fit on two or "
            f"more devices (Trainer(devices=N)) and {_FIX}"
        )
    if isinstance(strategy, (DeepSpeedStrategy, XLAStrategy)) or not isinstance(
        strategy, (DDPStrategy, ModelParallelStrategy)
    ):
        raise ValueError(
            f"{_WHERE}: strategy={name}: its collectives are not torch.distributed's FSDP2 or "
            f"DDP ones, which are all qsdp compresses; {_FIX}"
        )
    if trainer.world_size == 1:
        raise ValueError(
            f"{_WHERE}: strategy={name} with world_size=1 (one process): nothing crosses a "
            "wire; fit on two or more (Trainer(devices=N) with N >= 2, or num_nodes)"
        )


def _target(trainer: pl.Trainer) -> nn.Module:
    """The module qsdp installs on: DDP's wrapper, or the FSDP2 root inside the module."""
    _check_strategy(trainer)  # setup() ran it; a callback added later did not
    model = trainer.strategy.model
    if isinstance(trainer.strategy, DDPStrategy):
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"{_WHERE}: trainer.strategy.model is a {type(model).__name__}, not the "
                "DistributedDataParallel module DDPStrategy builds when fitting"
            )
        return model
    names = {m: n for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    # the roots: FSDP2 modules no other FSDP2 module contains
    roots = [n for n in names.values() if not any(_inside(n, o) for o in names.values())]
    if len(roots) == 1:
        return model.get_submodule(roots[0])
    if not roots:
        raise ValueError(
            f"{_WHERE}: {type(model).__name__} holds no FSDP2 module: under "
            "ModelParallelStrategy, call torch.distributed.fsdp.fully_shard in "
            "configure_model (on each block, then on the module training_step calls)"
        )
    raise ValueError(
        f"{_WHERE}: {type(model).__name__} holds {len(roots)} separate FSDP2 roots "
        f"{[r or '<the module>' for r in roots][:4]}; qsdp compresses one root with its blocks: "
        "fully_shard the module that holds them all (after its blocks) in configure_model"
    )


def _inside(name: str, other: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``other`` (qualified names)."""
    return name != other and (other == "" or name.startswith(other + "."))
