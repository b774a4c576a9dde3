"""The training loop of ``qsdp train``: FSDP2, compressed HSDP or compressed DDP (``parallel.py``).

One call of :func:`train_rank` per process, inside an initialised process group (see
``launch.py``). Every recipe sees the same initial weights and the same batches in the same
order (both keyed by ``seed``), so runs differ only in what their collectives send.

[Note: bytes on the wire]
``wire_bytes`` is what this rank sends in one optimizer step: qsdp's byte counter for the
collectives a recipe compresses (an all-gather sends its shard; a reduce-scatter the
``world - 1`` chunks meant for the peers; an all-reduce its tensor: ``qsdp.comm._stats``), plus
the same measure of the collectives it leaves to PyTorch (weights of a gradient-only recipe,
HSDP's reduce-scatter inside the node). ``bf16_bytes`` is that measure for the uncompressed
``"bf16"`` recipe with this run's precision (parameters gathered in the compute dtype: bf16 on
GPUs, fp32 on CPUs; forward and backward for resharded blocks, once for the root; gradients
reduced in fp32: reduce-scattered by FSDP2, all-reduced across HSDP's nodes and by DDP);
``compression_ratio`` is their quotient (``Parallel.reference_bytes``). Evaluation and
checkpoint traffic is excluded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from qsdp import (
    RECIPES,
    AdaptiveWidths,
    CompressionConfig,
    QuantizedGrads,
    Schedule,
    TwoLevelGrads,
    WeightDiffs,
    decode,
    encode,
    recipe,
)
from qsdp.policy import AutoDecision
from qsdp.runtime import StalenessGate, WeightPrediction, local_of

from .batches import DATA_ORDERS, Batches
from .checkpoint import load_checkpoint, save_checkpoint
from .data import TokenData
from .metrics import MetricsWriter, Progress
from .model import GPT, PRESETS, ModelConfig
from .parallel import MODES, Parallel, build
from .rundir import RUN_FILES, saved_choice, validate, write_config

PREDICTIONS = ("last", "local", "none")
"""``--predict``: where a staleness-1 step computes its gradient (see ``TrainConfig.predict``)."""

__all__ = ["COLUMNS", "PREDICTIONS", "Interrupted", "TrainConfig", "raise_together", "train_rank"]

T = TypeVar("T")

COLUMNS = (
    "step",
    "tokens",
    "loss",
    "val_loss",
    "lr",
    "tokens_per_s",
    "step_s",
    "wire_bytes",
    "wire_bytes_all_gather",
    "wire_bytes_reduce_scatter",
    "wire_bytes_all_reduce",
    "bf16_bytes",
    "compression_ratio",
    "quant_rel_err",
    "grad_norm",
    "stale_gap",
    "sync_forced",
    "grad_bytes_saved",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; saved as ``OUT/config.json``."""

    out: str
    """The run directory: new (or holding no run), or the run to continue with ``resume``."""
    recipe: str = "sdp4bit"
    preset: str = "cpu-tiny"
    data: str | None = None
    """None: the built-in corpus (Shakespeare); else a .txt, a .bin or a nanoGPT directory."""
    tokenizer: str | None = None
    """``byte`` (default for text) or ``gpt2``."""
    steps: int = 200
    micro_batch: int = 8
    grad_accum: int = 1
    block_size: int | None = None
    """Default: the preset's (capped by nothing else)."""
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 3
    """Keep the newest N checkpoints, deleting older ones once a new one is complete on every
    rank (0: keep all); the one ``ckpt/latest`` names is never deleted."""
    resume: bool = False
    """Continue the run in ``out`` from its last checkpoint. The settings that define the run
    must equal the saved ones (``rundir.RESUME_MUST_MATCH``: recipe, seed, data, ``steps``...);
    only when to stop, save, evaluate and how to report may change. Without it, ``out`` must not
    hold a run."""
    stop_at: int | None = None
    """End this process after this many steps (saving a checkpoint), as an interruption would;
    ``resume`` continues the same run. The schedule still spans ``steps``."""
    seed: int = 0
    data_order: str = "random"
    """``random`` (windows drawn anew each step) or ``pass`` (one pass over the train split,
    no window twice; a run longer than the split is refused): see ``batches.py``."""
    two_level: bool = True
    """Two-level recipes get a (nodes, GPUs per node) mesh under torchrun when both exceed 1."""
    parallel: str = "fsdp"
    """``fsdp``, ``hsdp`` (FSDP2 inside a node, the recipe's gradients compress the all-reduce
    across nodes) or ``ddp`` (DistributedDataParallel with qsdp's comm hook); see
    ``parallel.py``."""
    staleness: int = 0
    """``1``: each step applies the previous step's gradient while its own reduction overlaps the
    next step (the first step applies nothing and skips its optimizer step; the last gradient is
    applied by one more optimizer step at the end, with the last step's learning rate and
    clipping). See [Note: one staleness core] in ``qsdp.runtime.delayed``."""
    stale_after: int | str = "auto"
    """Staleness 1 only from this step on: the steps before reduce and apply at once (the
    pipeline's ``synchronous()``), the first stale step applies nothing; ``"auto"`` (default):
    qsdp starts it once the gradient norm has settled (``Schedule(start="auto")``, [Note: when
    staleness 1 starts] in ``qsdp.runtime.stale_start``); ``0``: from the first step."""
    predict: str | None = None
    """Staleness 1: where each step's gradient is computed ([Note: weight prediction]):
    ``local``, AdamW's next step with each rank's own gradient of the step in flight (under
    HSDP and over two levels, ``--nodes``, the node's average; GPT-125M on 2 GPUs: +1.9% of the
    loss against +19% with ``last``, docs/results.md); ``last``, the parameters plus the last
    update (``qsdp.WeightPrediction(opt)``); ``none``, the parameters as they are (the delayed
    gradient as is: +29%). None (the default) takes ``local`` at staleness 1 (``last``
    otherwise, where nothing is predicted); the resolved value is what ``config.json``
    records."""
    gather_ahead: bool = False
    """Staleness 1, FSDP2, a weight-difference recipe (``sdp4bit``): gather the next step's
    weights in this step's backward (``Schedule(gather_ahead=True)``, [Note: the next step's
    weights in this backward] in ``qsdp.runtime.gathered``); the schedule's own prediction,
    unclipped, replaces this loop's (``--predict local``). Not with ``--stale-bound`` or a
    ``--stale-after`` step (``auto`` or 0)."""
    graphs: bool = False
    """On CUDA, FSDP2 or synchronous DDP (``cgx``, ``qsdp-g8``): replay the hooks' codecs from
    CUDA graphs (``Schedule(graphs=True)``, [Note: codec segments replayed] in
    ``qsdp.comm._graphs``): the same bits with less host work a step, for a fast link. Not
    recorded as a setting a resumed run must keep (it changes no bits)."""
    stale_bound: float | None = None
    """Staleness 1: force a synchronous step when ``lr * ||g||`` (clipped) of the applied
    gradient exceeds it (``qsdp.StalenessGate``, [Note: the staleness gate]); None never forces
    one. Every step logs the proxy (``stale_gap``) and the forced steps so far
    (``sync_forced``)."""
    adaptive_every: int | None = None
    """Adaptive gradient widths (``qsdp.AdaptiveWidths``): re-decide each group's width among 2,
    3, 4, 6 and 8 bits every this many steps (first after ``min(50, steps // 10)``); recipes
    with quantized gradients. The last plan's saving is logged as ``grad_bytes_saved``."""
    adaptive_per_parameter: bool = False
    """With ``adaptive_every``: a width per parameter tensor, not per FSDP2 group
    (``AdaptiveWidths(per_parameter=True)``; FSDP2 at staleness 0)."""
    adaptive_error: str = "absolute"
    """With ``adaptive_every``: what the width budget counts, ``absolute`` or ``relative``
    squared errors (``AdaptiveWidths.error``)."""
    redecide: bool = False
    """``--recipe auto`` with ``--resume``: measure and choose again instead of keeping the
    run's choice (a network that changed). A different choice starts its collectives' state
    afresh (noise counters, weight-difference reconstructions); the model, optimizer and data
    order come from the checkpoint as always."""
    error_feedback: bool = False
    """DDP with quantized gradients (``cgx``, ``qsdp-g8``): keep what each rank's quantizer
    loses and add it to its next gradient (``qsdp.ddp.register(..., error_feedback=True)``)."""
    grad_rounding: str | None = None
    """Recipes with quantized gradients (``cgx``, ``qsdp-g8``): replace their quantizer's
    rounding, ``"stochastic"`` or ``"nearest"`` (lower error, biased: for error feedback, which
    re-sends what rounding lost)."""
    grad_group_size: int | None = None
    """Recipes with quantized gradients: replace their quantizer's group size (elements per
    scale; CGX's bucket)."""
    ddp_bucket_mb: float | None = None
    """``ddp``: DDP's ``bucket_cap_mb`` (default DDP's own, 25). Buckets decide what each hook
    call quantizes and exchanges together; over sockets ``cgx`` ran fastest with 100-150 MiB
    (docs/results.md, DDP)."""
    pipeline: bool = False
    """``ddp`` or ``hsdp`` with compressed gradients (or ``auto``, when it compresses):
    ``Schedule(pipeline=True)`` for ``qsdp.ddp.register`` or ``compress_fsdp``, one
    bucket's (module's) later exchange overlapping the next one's on a second communicator (the
    same results)."""
    nodes: int | None = None
    """``hsdp``: the number of nodes (default: torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``, or 2
    emulated nodes on one machine). ``fsdp``: the nodes of two-level recipes' and ``auto``'s
    (inter, intra) mesh, emulated on one host (default: torchrun's, as ``two_level`` says)."""
    tensorboard: bool | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES and self.recipe != "auto":
            raise ValueError(
                f"unknown recipe {self.recipe!r}; choose one of {sorted(RECIPES)} or 'auto'"
            )
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        for name in ("steps", "micro_batch", "grad_accum", "eval_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for name in ("warmup", "eval_every", "ckpt_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise ValueError(f"--stop-at must be in [1, --steps], got {self.stop_at}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError("--block-size must be positive")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        if self.data_order not in DATA_ORDERS:
            raise ValueError(f"--data-order {self.data_order!r} must be one of {DATA_ORDERS}")
        if self.parallel not in MODES:
            raise ValueError(f"parallel={self.parallel!r} must be one of {MODES}")
        if self.nodes is not None and (self.parallel == "ddp" or self.nodes < 2):
            raise ValueError(
                f"--nodes={self.nodes} is for --hsdp or FSDP's two-level recipes, and at least 2"
            )
        if self.staleness not in (0, 1):
            raise ValueError(f"--staleness must be 0 or 1, got {self.staleness}")
        if self.stale_after != "auto" and (
            isinstance(self.stale_after, bool)
            or not isinstance(self.stale_after, int)
            or (self.stale_after and (not self.staleness or not 0 < self.stale_after < self.steps))
        ):
            raise ValueError(
                f"--stale-after={self.stale_after} must be 'auto', 0 (from the first step) or, "
                "with --staleness 1, a step in (0, --steps)"
            )
        if self.predict is None:  # the best that applies (frozen: set once, here)
            best = "local" if self.staleness else "last"
            object.__setattr__(self, "predict", best)
        if self.predict not in PREDICTIONS:
            raise ValueError(f"--predict must be one of {PREDICTIONS}, got {self.predict!r}")
        if self.predict != "last" and not self.staleness:
            raise ValueError(
                f"--predict {self.predict} is for --staleness 1 (a synchronous step predicts "
                "nothing)"
            )
        if self.gather_ahead and not (
            self.staleness
            and self.parallel == "fsdp"
            and self.predict == "local"
            and self.stale_bound is None
            and self.stale_after in ("auto", 0)
        ):
            raise ValueError(
                "--gather-ahead is for --staleness 1 under FSDP2 with --predict local, the "
                "automatic start or --stale-after 0, and no --stale-bound (the schedule predicts "
                f"and starts itself); got staleness={self.staleness}, parallel={self.parallel}, "
                f"predict={self.predict}, stale_after={self.stale_after}, "
                f"stale_bound={self.stale_bound}"
            )
        ddp_replays = self.recipe in ("cgx", "qsdp-g8") and not self.error_feedback
        if self.graphs and (
            self.recipe == "auto"
            or self.parallel not in ("fsdp", "ddp")
            or (self.parallel == "ddp" and (not ddp_replays or self.staleness))
        ):
            raise ValueError(
                "--graphs replays the codecs of FSDP2's hooks and of DDP's synchronous two-phase "
                f"all-reduce; got staleness={self.staleness}, parallel={self.parallel}, "
                f"recipe={self.recipe}, error_feedback={self.error_feedback}: use it under "
                "FSDP2 with a named recipe or under DDP at --staleness 0 with cgx or qsdp-g8 "
                "(no --error-feedback), or drop it"
            )
        if self.stale_bound is not None and (not self.staleness or not self.stale_bound > 0):
            raise ValueError(
                f"--stale-bound={self.stale_bound} needs --staleness 1 and a positive bound "
                "(the largest lr * gradient norm a delayed update may have)"
            )
        if self.adaptive_every is not None and self.adaptive_every < 1:
            raise ValueError(f"--adaptive-every must be positive, got {self.adaptive_every}")
        if self.adaptive_per_parameter and (
            not self.adaptive_every or self.parallel != "fsdp" or self.staleness
        ):
            raise ValueError(
                "--adaptive-per-parameter needs --adaptive-every N and FSDP2 at staleness 0 "
                "(not --ddp, --hsdp or --staleness 1): drop it, or those"
            )
        if self.adaptive_error != "absolute" and not self.adaptive_every:
            raise ValueError(
                f"--adaptive-error {self.adaptive_error} needs --adaptive-every N: drop it, or "
                "add that"
            )
        if self.error_feedback and (
            self.parallel != "ddp"
            or self.recipe == "auto"
            or not isinstance(recipe(self.recipe).grads, QuantizedGrads)
        ):
            raise ValueError(
                f"--error-feedback is for --ddp with quantized gradients (cgx, qsdp-g8), not "
                f"--recipe {self.recipe} under {self.parallel}: drop it, or use those"
            )
        if self.ddp_bucket_mb is not None and (
            self.parallel != "ddp" or not self.ddp_bucket_mb > 0
        ):
            raise ValueError(
                f"--ddp-bucket-mb {self.ddp_bucket_mb} is DDP's bucket size in MiB: give a "
                f"positive size with --ddp (this run is {self.parallel}), or drop it"
            )
        if self.pipeline and (
            self.parallel == "fsdp"
            or (self.recipe != "auto" and recipe(self.recipe).grads is None)
            or (self.parallel == "hsdp" and self.staleness)
        ):
            raise ValueError(
                f"--pipeline is for --ddp, or --hsdp at staleness 0, with compressed gradients "
                f"(cgx, qsdp-g8, global-qsgd), not --recipe {self.recipe} under {self.parallel}"
                f"{' at staleness 1' if self.staleness else ''}: drop it, or use those"
            )
        overrides = {
            "--grad-rounding": self.grad_rounding,
            "--grad-group-size": self.grad_group_size,
        }
        for flag, value in overrides.items():
            if value is not None and (
                self.recipe == "auto" or not isinstance(recipe(self.recipe).grads, QuantizedGrads)
            ):
                raise ValueError(
                    f"{flag} {value} is for recipes with quantized gradients (cgx, qsdp-g8), not "
                    f"--recipe {self.recipe}: drop it, or use those"
                )
        if self.grad_rounding not in (None, "stochastic", "nearest"):
            raise ValueError(
                f"--grad-rounding must be 'stochastic' or 'nearest', got {self.grad_rounding!r}"
            )
        if self.redecide and (self.recipe != "auto" or not self.resume):
            raise ValueError(
                f"--redecide is for resuming a --recipe auto run (got --recipe {self.recipe}"
                f"{'' if self.resume else ' without --resume'}): drop it"
            )
        if self.recipe == "auto":
            if self.staleness or self.adaptive_every:
                raise ValueError(
                    "--recipe auto picks a recipe from measurements; it takes no --staleness or "
                    "--adaptive-every yet: name a recipe for those"
                )
            return
        self.compression()  # refuses adaptive widths for a recipe without quantized gradients
        config = recipe(self.recipe)
        if self.gather_ahead and not isinstance(config.weights, WeightDiffs):
            raise ValueError(
                f"--gather-ahead gathers weight differences; --recipe {self.recipe} gathers "
                "none: use sdp4bit (or another recipe with weight differences), or drop it"
            )
        if self.parallel != "fsdp" and config.two_level:
            raise ValueError(
                f"--recipe {self.recipe} has two-level gradients (a reduce-scatter); --"
                f"{self.parallel} all-reduces: use cgx, qsdp-g8, global-qsgd or bf16"
            )
        if self.parallel == "ddp" and config.weights is not None:
            raise ValueError(
                f"--recipe {self.recipe} compresses weights, which DDP does not gather; use a "
                "gradient-only recipe with --ddp: cgx, qsdp-g8, global-qsgd or bf16"
            )

    def schedule(self) -> Schedule:
        """When the collectives run: ``--staleness``, ``--pipeline``, ``--graphs``."""
        if not self.staleness:
            return Schedule(pipeline=self.pipeline, graphs=self.graphs)
        # an explicit --stale-after: this loop runs the steps before it synchronous()
        start = "auto" if self.stale_after == "auto" else 0
        if self.gather_ahead:  # the schedule's own prediction, which the gathers ahead take
            return Schedule(staleness=1, start=start, predict="local", gather_ahead=True)
        # this loop predicts by hand (--predict, aware of its gate's synchronous steps), so
        # the schedule's own prediction stays off
        return Schedule(
            staleness=self.staleness, pipeline=self.pipeline, start=start, predict="none"
        )

    def compression(self) -> CompressionConfig | str:
        """The recipe with this run's overrides (adaptive widths, group size); ``"auto"`` is
        decided when the model is built (``Parallel.config`` then holds the choice)."""
        if self.recipe == "auto":
            return "auto"
        adaptive = None
        if self.adaptive_every:
            adaptive = AdaptiveWidths(
                every=self.adaptive_every,
                warmup=min(50, max(1, self.steps // 10)),
                per_parameter=self.adaptive_per_parameter,
                error=self.adaptive_error,
            )
        config = recipe(self.recipe, adaptive=adaptive)
        changes = {"rounding": self.grad_rounding, "group_size": self.grad_group_size}
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:  # QuantizedGrads (checked above); QuantSpec checks the values
            spec = dataclasses.replace(config.grads.spec, **changes)
            config = dataclasses.replace(config, grads=dataclasses.replace(config.grads, spec=spec))
        return config

    def model_config(self, vocab_size: int) -> ModelConfig:
        base = PRESETS[self.preset]  # every option of the preset kept, these three replaced
        return dataclasses.replace(
            base,
            block_size=self.block_size or base.block_size,
            vocab_size=vocab_size,
            dropout=self.dropout,
        )


def _choice(record: dict | None) -> tuple:
    """What an ``"auto"`` record chose (per collective for FSDP2), to compare two decisions."""
    record = record or {}
    return tuple(record.get(k) for k in ("recipe", "weights", "grads"))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step.

    [Note: the delayed gradient's learning rate]
    At staleness 1 the optimizer step of step ``t`` applies the gradient of step ``t - 1``'s
    batch; it takes that step's rate, ``lr_at(t - 1)``, so the run applies the synchronous
    run's (batch, rate) pairs in the synchronous order, one step late (and weight prediction,
    which computes AdamW's next step, predicts with the rate that step will use). Until
    2026-11-27 it took ``lr_at(t)``, the schedule shifted by a step. A step applies a delayed
    gradient exactly when one is in flight as it starts (``state.in_flight``); every other step
    is synchronous (after the gate fired, before ``--stale-after``, or before the automatic start
    of ``Schedule(start="auto")``) and applies its own gradient at its own rate, or applies
    nothing (the first delayed step). Until 2026-11-29 the automatic start's synchronous steps
    took ``lr_at(t - 1)`` too: the warm-up one step behind, and those steps no longer the
    synchronous run's (a 30-step run with a 25-step warm-up was 4.6% above it when the delayed
    schedule started at step 22). The gate's extra step and the last drain apply step ``t``'s
    gradient at ``lr_at(t)``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def _set_lr(opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> float:
    """Give every parameter group step ``step``'s learning rate; returns it."""
    lr = lr_at(cfg, step)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def _bf16_compute(cfg: TrainConfig, device: torch.device) -> bool:
    """bf16 parameters for compute on GPUs; fp32 on CPUs (gloo) and for the quantized master,
    which gathers the fp32 master itself."""
    return device.type == "cuda" and cfg.recipe != "qsdp-quantized-master"


def _split_bytes(delta: dict[str, int]) -> tuple[int, int, int]:
    ag = sum(v for k, v in delta.items() if k.startswith("all_gather"))
    rs = sum(v for k, v in delta.items() if "reduce_scatter" in k)
    return ag, rs, sum(delta.values()) - ag - rs


def _quant_error(model: GPT, config: CompressionConfig) -> float | None:  # the GPT itself
    """Relative L2 error of the recipe's gradient quantizer on a sample of a gradient shard."""
    grads = config.grads
    if isinstance(grads, TwoLevelGrads):
        spec = grads.inter  # the coarser of the two levels
    elif isinstance(grads, QuantizedGrads):
        spec = grads.spec
    else:
        return None
    grad = model.blocks[0].up.weight.grad
    if grad is None:
        return None
    local = local_of(grad)
    x = local.reshape(-1)[: 1 << 16].float()
    if x.numel() == 0 or not bool(torch.isfinite(x).all()) or float(x.norm()) == 0:
        return None
    y = decode(encode(x, spec, seed=7, step=0))
    return float((y - x).norm() / x.norm())


def _evaluate(par: Parallel, batches: Batches, cfg: TrainConfig, device: torch.device) -> float:
    model = par.model
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in batches.val_batches(
            cfg.eval_batches,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            micro_batch=cfg.micro_batch,
            block_size=par.gpt.config.block_size,
        ):
            with par.autocast(device):
                _, loss = model(x.to(device), y.to(device))
            n = torch.tensor(float(x.numel()), dtype=torch.float64, device=device)
            total += torch.stack((loss.detach().double() * n, n))
    dist.all_reduce(total)
    model.train()
    # FSDP2 keeps the root's parameters unsharded after a forward (for its backward); with no
    # backward here they would stay so, and the next step's forward would reuse them without
    # an all-gather: staleness 1's prediction, which moves the sharded parameters before that
    # forward, would miss the root's (found as an inexact resume after an evaluation)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return float(total[0] / total[1])


def _bytes_saved(par: Parallel) -> float | None:
    """Adaptive widths: the share of the uniform width's gradient bytes the last plan saves."""
    widths = getattr(par.state, "widths", None)
    return widths.plan.bytes_saved if widths is not None and widths.plan is not None else None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or a SIGTERM ended the run; raised on every rank after the checkpoint, if
    any.

    [Note: Ctrl-C between steps]
    A SIGINT does not interrupt a rank where it lands (mid-collective, its peers would hang or
    fail): it only asks to stop. Each step's loss all-reduce carries every rank's request, so all
    ranks see it after the same step, leave the loop together, and save that step as
    ``--stop-at`` would (a step of staleness 1 keeps its reduction in flight in the checkpoint).
    Then each raises this. Under ``qsdp train``'s own launcher a Ctrl-C reaches the launcher,
    which forwards it to the workers (a second Ctrl-C kills them: nothing more is saved).
    A SIGTERM (a scheduler preempting the job, ``kill``; torchrun forwards it to its workers)
    is the same request: the run stops after the step every rank sees it in, saves it, and
    exits with 143 (128 + SIGTERM) where a Ctrl-C exits with 130.

    Attributes:
        step: the steps completed (None: interrupted before one was).
        checkpoint: the checkpoint written for them, or None when none could be.
        out: the run directory.
        signum: the signal that asked to stop (SIGINT or SIGTERM).
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None,
        checkpoint: Path | None,
        out: Path,
        signum: int = signal.SIGINT,
    ):
        super().__init__(message)
        self.step, self.checkpoint, self.out = step, checkpoint, out
        self.signum = int(signum)


class _StopRequest:
    """A SIGINT and SIGTERM handler for the duration of a run that records the request instead
    of raising or dying (only in the main thread, where Python runs signal handlers)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.presses = 0
        self.signum: int | None = None
        """The first signal that asked to stop."""
        self._previous: dict[int, object] = {}

    @property
    def asked(self) -> bool:
        return self.presses > 0

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = previous = signal.signal(signum, self._ask)
                outer = getattr(previous, "__self__", None)
                if isinstance(outer, _StopRequest):  # a request made before this run took over
                    self.presses = max(self.presses, outer.presses)
                    self.signum = self.signum or outer.signum
        return self

    def _ask(self, signum: int, frame: object) -> None:
        self.presses += 1
        self.signum = self.signum or signum

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _stopped_by(signum: int | None) -> str:
    """How a stop request reads in the run's last line."""
    return "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"


def _clear_unsaved_run(out: Path) -> None:
    """Rank 0 of a new run: remove what a run that never finished a checkpoint left in ``out``
    (``rundir.validate`` let it start afresh there)."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if not found:
        return
    print(
        f"qsdp train: {out} holds a run with no finished checkpoint ({', '.join(found)}): "
        "starting afresh over it",
        flush=True,
    )
    for name in found:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


_REBUILT = {
    t.__name__: t
    for t in (
        ValueError,
        TypeError,
        ImportError,
        FileExistsError,
        FileNotFoundError,
        NotADirectoryError,
    )
}


def raise_together(fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raises on any, raise on all of them.

    A rank that raised re-raises its own error; the others raise the first failing rank's
    (same type where it is a user error, else ``RuntimeError``), so no rank goes on into a
    collective that its peer has left.

    Args:
        fn: the check (or preparation) to run; called once on each rank.

    Returns:
        What ``fn`` returned on this rank.
    """
    error: Exception | None = None
    value = None
    try:
        value = fn()
    except Exception as e:  # every rank must learn of it, whatever it is
        error = e
    report = None if error is None else (type(error).__name__, str(error))
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if error is not None:
        raise error
    for rank, r in enumerate(reports):
        if r is not None:
            kind, message = r
            raise _REBUILT.get(kind, RuntimeError)(f"{message} (on rank {rank})")
    return value  # type: ignore[return-value]


def train_rank(cfg: TrainConfig, data: TokenData, device: torch.device) -> dict:
    """Train on this rank; returns the final metrics (rank 0 also writes ``OUT/``).

    Raises:
        Interrupted: a SIGINT (Ctrl-C) asked to stop; every rank stopped after the same step,
            whose checkpoint was saved ([Note: Ctrl-C between steps]).
    """
    with _StopRequest() as stop:
        return _train_rank(cfg, data, device, stop)


def _train_rank(
    cfg: TrainConfig, data: TokenData, device: torch.device, stop: _StopRequest
) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    # Before anything is written (see rundir's notes); on every rank, so all raise together.
    raise_together(lambda: validate(cfg, data, world_size=ws, columns=COLUMNS))
    if cfg.graphs and device.type != "cuda":  # (the same device type on every rank)
        raise ValueError(f"--graphs replays CUDA graphs; this run is on {device.type}: drop it")
    out = Path(cfg.out)
    mc = cfg.model_config(data.vocab_size)
    batches = Batches(data, order=cfg.data_order)
    compression = cfg.compression()
    saved = saved_choice(out) if cfg.resume and compression == "auto" else None
    chosen = None if cfg.redecide else saved
    recorded = AutoDecision.from_record(chosen) if chosen else None
    resumed = recorded.config() if recorded is not None else None
    par = build(
        mode=cfg.parallel,
        recipe_name=cfg.recipe,
        mc=mc,
        device=device,
        seed=cfg.seed,
        bf16=_bf16_compute(cfg, device),
        # a resumed "auto" uses the mesh only if it chose two levels
        two_level=cfg.two_level and (recorded is None or recorded.two_level),
        nodes=cfg.nodes,
        error_feedback=cfg.error_feedback,
        ddp_bucket_mb=cfg.ddp_bucket_mb,
        # (a resumed "auto" that chose no compression has nothing to pipeline)
        schedule=dataclasses.replace(
            cfg.schedule(),
            pipeline=cfg.pipeline and (resumed is None or resumed.grads is not None),
        ),
        # "auto" resumes with the recipe it chose, never a new measurement's
        config=resumed if resumed is not None else compression,
    )
    model = par.model
    config = par.config  # for "auto": the recipe it chose
    decision = getattr(par.state, "decision", None)
    if decision is not None:
        chosen = decision.record()
    # --redecide: a new choice's collectives start afresh (another recipe's state would not fit)
    changed = cfg.redecide and _choice(chosen) != _choice(saved)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # (torch's default implementation everywhere. On CPU the fused AdamW is ~3x faster on
    # FSDP2's DTensors, but a run resumed from its checkpoint then ended 1 ulp off its
    # uninterrupted twin (2-layer GPTs, HSDP and two-level staleness 1, 2026-11-29; with the
    # default the same runs resume exactly): its vectorised loop likely rounds by alignment)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    # staleness 1: gradients computed at the predicted parameters ([Note: weight prediction])
    # (--gather-ahead: the schedule predicts, told the optimizer below)
    predict = (
        WeightPrediction(opt, local=par.state if cfg.predict == "local" else None)
        if cfg.staleness and cfg.predict != "none" and not cfg.gather_ahead
        else None
    )
    start, (forced, sync_next) = (
        load_checkpoint(out, par, opt, predict=predict, comm_state=not changed)
        if cfg.resume
        else (0, (0, 0))
    )
    if cfg.gather_ahead:  # (a resumed reduction in flight is predicted from the first step)
        par.state.predict_with(opt)
    if cfg.redecide:
        chosen = dict(chosen, redecided_at=start, previous=saved)
        if rank == 0:
            print(
                f"qsdp train: --redecide at step {start}: auto chose {chosen['recipe']} (was "
                f"{saved['recipe']}){'; its collectives start afresh' if changed else ''}",
                flush=True,
            )
    if rank == 0:
        if not cfg.resume:
            _clear_unsaved_run(out)
        out.mkdir(parents=True, exist_ok=True)
        write_config(cfg, out, data, device, auto=chosen)
    dist.barrier()
    compute_bytes = 2 if _bf16_compute(cfg, device) else 4
    (full_ag, full_rs, full_ar), (plain_ag, plain_rs, plain_ar) = par.reference_bytes(
        config, compute_bytes, cfg.grad_accum
    )
    stats = par.stats
    tokens_per_step = cfg.micro_batch * mc.block_size * cfg.grad_accum * ws
    writer = (
        MetricsWriter(
            out,
            COLUMNS,
            # rows of steps after the checkpoint are replayed: drop them
            resume_from_step=start - 1 if cfg.resume else None,
            tensorboard=cfg.tensorboard,
        )
        if rank == 0
        else None
    )
    gate = StalenessGate(cfg.stale_bound or math.inf) if cfg.staleness else None
    if gate is not None:
        gate.fired = forced
    progress = Progress(cfg.steps, initial=start, disable=rank != 0 or not cfg.progress)

    def checkpoint(done: int) -> Path:
        """Save the run after ``done`` steps, with the gate's count and whether the next step
        is synchronous (read when called)."""
        gate_state = (gate.fired if gate else 0, int(sync_next))
        return save_checkpoint(
            out, par, opt, done, gate_state, predict=predict, keep=cfg.keep_checkpoints
        )

    last: dict = {}
    announced = False  # (rank 0 said when staleness 1 started)
    interrupted = cut = False
    try:
        end = cfg.steps if cfg.stop_at is None else max(start, cfg.stop_at)
        for step in range(start, end):
            # after the staleness gate fired, one step reduces and applies at once
            # (and through --stale-after's first steps)
            after = 0 if cfg.stale_after == "auto" else cfg.stale_after
            sync_step = bool(sync_next) or bool(cfg.staleness and step < after)
            sync_next = False
            # [Note: the delayed gradient's learning rate]: this step applies the previous
            # step's gradient exactly when one is in flight as it starts
            # (a synchronous step never has one: the gate drained, or none was made yet)
            delayed = bool(cfg.staleness) and par.state.in_flight
            lr = _set_lr(opt, cfg, step - 1 if delayed else step)
            before = {k: v.bytes for k, v in stats.snapshot().items()}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            # a step whose backward applies a reduction in flight computes ahead, through
            # all its micro-batches
            ahead = (
                predict.ahead(enabled=not sync_step and par.state.in_flight, clip=cfg.grad_clip)
                if predict is not None
                else contextlib.nullcontext()
            )
            with ahead:
                for micro in range(cfg.grad_accum):
                    x, y = batches.train_batch(
                        step,
                        micro,
                        rank=rank,
                        world_size=ws,
                        micro_batch=cfg.micro_batch,
                        block_size=mc.block_size,
                        seed=cfg.seed,
                        grad_accum=cfg.grad_accum,
                    )
                    synchronous = par.state.synchronous() if sync_step else contextlib.nullcontext()
                    with par.micro_step(micro == cfg.grad_accum - 1), synchronous:
                        with par.autocast(device):
                            _, loss = model(x.to(device), y.to(device))
                        (loss / cfg.grad_accum).backward()
                    loss_sum += loss.detach() / cfg.grad_accum
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            # staleness 1: a step whose backward applied no reduction (the first, the one after
            # a forced synchronous step) takes no optimizer step; see [Note: the staleness gate]
            applies = not (cfg.staleness and par.state.applied_nothing)
            # (DDP's and HSDP's gradients are the decoded all-reduce already: re-encoding them
            # measures nothing)
            sample = par.mode == "fsdp" and cfg.eval_every > 0
            qerr = (
                _quant_error(par.gpt, config)
                if sample and (step % cfg.eval_every == 0 or step == cfg.steps - 1)
                else None
            )
            if applies:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if cfg.staleness and rank == 0 and not announced:
                since = par.state.delayed_since
                if since is not None and since > 0:  # (Schedule(start="auto") decided)
                    print(
                        f"qsdp train: the gradient norm settled after {since} synchronous "
                        f"steps; staleness 1 from step {since} on (it applies nothing)",
                        flush=True,
                    )
                announced = since is not None
            if gate is not None and applies and not sync_step:
                if gate.check(grad_norm=norm, lr=lr, clip=cfg.grad_clip):
                    # the same verdict on every rank (the norm is of the reduced gradient):
                    # apply the reduction in flight now; the next step computes synchronously
                    par.state.drain()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    _set_lr(opt, cfg, step)  # this step's own gradient, its own rate
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sync_next = True
            # [Note: Ctrl-C between steps]: every rank's stop request travels with the loss
            summed = torch.stack((loss_sum, torch.tensor(float(stop.asked), device=device)))
            dist.all_reduce(summed)
            loss_val = float(summed[0]) / ws  # waits for the step
            interrupted = bool(summed[1] > 0)
            step_s = time.perf_counter() - t0
            after = {k: v.bytes for k, v in stats.snapshot().items()}
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            ag, rs, ar = _split_bytes(delta)
            ag, rs, ar = ag + plain_ag, rs + plain_rs, ar + plain_ar
            wire = ag + rs + ar
            val = None
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
                val = _evaluate(par, batches, cfg, device)
            if not math.isfinite(loss_val):
                raise FloatingPointError(
                    f"the training loss is {loss_val} at step {step}: lower --lr, raise "
                    "--warmup, or check the data"
                )
            last = dict(
                tokens=(step + 1) * tokens_per_step,
                loss=loss_val,
                val_loss=val,
                lr=lr,
                tokens_per_s=tokens_per_step / step_s,
                step_s=step_s,
                wire_bytes=wire,
                wire_bytes_all_gather=ag,
                wire_bytes_reduce_scatter=rs,
                wire_bytes_all_reduce=ar,
                bf16_bytes=full_ag + full_rs + full_ar,
                compression_ratio=(full_ag + full_rs + full_ar) / wire if wire else None,
                quant_rel_err=qerr,
                grad_norm=float(norm),
                stale_gap=gate.gap if gate is not None and applies and not sync_step else None,
                sync_forced=gate.fired if gate is not None else None,
                grad_bytes_saved=_bytes_saved(par),
            )
            if writer is not None:
                writer.log(step, **last)
            progress.update(
                step + 1,
                loss=loss_val,
                tokens_per_s=last["tokens_per_s"],
                compression_ratio=last["compression_ratio"],
                val_loss=val,
            )
            done = step + 1
            if interrupted and done < end:
                end, cut = done, True  # saved below, as --stop-at would
                break
            if cfg.ckpt_every and done % cfg.ckpt_every == 0 and done < end:
                checkpoint(done)
        if cfg.staleness and start < end == cfg.steps:
            # the last step's gradient is still in flight: one more optimizer step applies it
            par.state.drain()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            _set_lr(opt, cfg, cfg.steps - 1)  # the last step's gradient, the last step's rate
            opt.step()
            opt.zero_grad(set_to_none=True)
        if start < end:
            path = checkpoint(end)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    if cut:
        raise Interrupted(
            f"{_stopped_by(stop.signum)} after step {end} of {cfg.steps}; saved {path}",
            step=end,
            checkpoint=path,
            out=out,
            signum=stop.signum or signal.SIGINT,
        )
    return last
