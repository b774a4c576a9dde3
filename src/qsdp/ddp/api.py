"""``qsdp.ddp.register``: install :class:`DDPCompression` on a DDP model (see ``hook.py``)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm as qc
from ..config import (
    CompressionConfig,
    IntegerGrads,
    QuantizedGrads,
    Schedule,
    as_schedule,
    recipe,
)
from ..policy import auto
from ..runtime.agreement import check_same_arguments
from ..runtime.prediction import AutoPrediction
from ..runtime.streams import twin_group
from .hook import DDPCompression

__all__ = ["register"]


def register(
    model: DDP,
    config: CompressionConfig | str,
    *,
    schedule: Schedule | None = None,
    error_feedback: bool = False,
) -> DDPCompression:
    """Compress ``model``'s gradient all-reduce: installs a DDP comm hook.

    Call it after wrapping the model in ``DistributedDataParallel`` and before the first
    backward, on every rank. The user's own ``torch.distributed`` calls are untouched.

    Args:
        model: a ``torch.nn.parallel.DistributedDataParallel`` module.
        config: a :class:`qsdp.CompressionConfig` or a recipe name: ``"cgx"`` (CGX: two-phase
            all-reduce, 4-bit min-max, groups of 256, stochastic), ``"global-qsgd"`` (integer
            all-reduce, int8 carrier), ``"qsdp-g8"`` (8-bit min-max two-phase), or ``"bf16"``
            (uncompressed, counted; as DDP's own all-reduce, NaN/Inf travel in the sum to every
            rank), or ``"auto"`` (measured, see ``qsdp.policy.auto``). Weights must be
            uncompressed (DDP gathers none).
        error_feedback: keep what the local quantizer loses and add it to the next step's
            gradient (quantized gradients only).
        schedule: when and on which communicators the all-reduce runs (a
            :class:`qsdp.Schedule`; default: synchronous, one communicator; see [Note: what
            and when]): ``staleness=1`` ([Note: staleness 1 under DDP] in ``qsdp/ddp/hook.py``);
            ``pipeline=True``: the all-reduce's later exchange (CGX's phase 2, Global-QSGD's
            SUM) on a second communicator over DDP's ranks and the buckets alternating between
            two hook streams, so one bucket's exchange overlaps the next one's (compressed
            gradients; the same results; [Note: pipelined buckets]); with ``"auto"``: when it
            chooses to compress. ``own_reduce_group`` is FSDP2's.

    Returns:
        The hook's :class:`DDPCompression`: its ``stats`` count the bytes; save it with
        ``torch.distributed.checkpoint`` beside the model (it is a ``Stateful``).

    Raises:
        TypeError: ``model`` is not a DDP module, ``config`` of the wrong type.
        ValueError: the config compresses weights, or has two-level gradients (a
            reduce-scatter; DDP all-reduces), error feedback with integer gradients, other
            arguments on another rank of DDP's group (one all-gather first, see [Note: one
            config on every rank]), ``schedule.pipeline`` with uncompressed gradients, an
            explicit ``schedule.own_reduce_group``, ``schedule.graphs`` without CGX's two
            phases on CUDA or with error feedback.
    """
    if not isinstance(model, DDP):
        raise TypeError(
            f"qsdp.ddp.register needs a DistributedDataParallel module, got "
            f"{type(model).__name__}; wrap it first: DistributedDataParallel(model)"
        )
    # the same on every rank of DDP's group, before anything can raise on one rank alone
    schedule = as_schedule(schedule, where="qsdp.ddp.register")
    check_same_arguments(
        (config, schedule, error_feedback),
        groups=[model.process_group],
        what="qsdp.ddp.register",
    )
    decision = None
    if config == "auto" and schedule.graphs:  # (before it measures anything)
        _check_graphs(model, config, "'auto'", error_feedback)
    if config == "auto":  # measure, predict, pick: see qsdp.policy.auto
        decision = _auto(model, pipeline=schedule.pipeline)
        # (with pipeline=True: off, and said, if it chose DDP's own all-reduce)
        name, config = "auto", decision.config()
        schedule = dataclasses.replace(schedule, pipeline=decision.pipeline)
    elif isinstance(config, str):
        name = config
        config = recipe(config)
    elif isinstance(config, CompressionConfig):
        name = "the config"
    else:
        raise TypeError(
            f"config must be a qsdp.CompressionConfig or a recipe name, got {type(config).__name__}"
        )
    if config.weights is not None:
        raise ValueError(
            f"{name} compresses weights, which DDP does not gather; use a gradient-only recipe "
            "('cgx', 'qsdp-g8', 'global-qsgd') or CompressionConfig(grads=...)"
        )
    if schedule.gather_ahead:
        raise ValueError(
            "Schedule(gather_ahead=True) gathers FSDP2's weight differences ahead; DDP "
            "gathers no weights: drop gather_ahead"
        )
    if schedule.graphs and schedule.staleness:
        raise ValueError(
            "Schedule(graphs=True, staleness=1) under DDP: a delayed bucket's result is a "
            "new buffer each step, which its replayed NaN/Inf check cannot key; not built "
            "(FSDP2 replays its delayed reductions): drop graphs, or set staleness=0"
        )
    if schedule.graphs:
        _check_graphs(model, config, name, error_feedback)
    if schedule.own_reduce_group is not None:
        raise ValueError(
            "Schedule.own_reduce_group is for FSDP2 (its reduce-scatters and weight "
            "all-gathers share a communicator); DDP runs only its gradient all-reduce: drop it"
        )
    if config.grads is not None and not isinstance(config.grads, (QuantizedGrads, IntegerGrads)):
        raise ValueError(
            f"{name} has {type(config.grads).__name__}, a reduce-scatter; DDP all-reduces: use "
            "QuantizedGrads (CGX's two phases) or IntegerGrads (Global-QSGD)"
        )
    if config.adaptive is not None and config.adaptive.per_parameter:
        raise ValueError(
            "AdaptiveWidths(per_parameter=True) is built for FSDP2's synchronous reduce-scatter; "
            "DDP adapts a width per bucket: use per_parameter=False"
        )
    if error_feedback and not isinstance(config.grads, QuantizedGrads):
        raise ValueError(
            "error_feedback=True needs quantized gradients (QuantizedGrads: 'cgx', 'qsdp-g8'); "
            "Global-QSGD's integer codes are unbiased and carry no local residual"
        )
    if schedule.pipeline and config.grads is None:
        raise ValueError(
            f"Schedule(pipeline=True) runs a compressed all-reduce's later exchange on a second "
            f"communicator; {name} has uncompressed gradients (DDP's own all-reduce): drop it"
        )
    second_group = None
    if schedule.pipeline:  # only DDP's ranks take part (DDP's group may be a subgroup)
        ranks = dist.get_process_group_ranks(model.process_group)
        second_group = twin_group(ranks)  # [Note: qsdp's own communicators]
    names = {id(p): n for n, p in model.module.named_parameters()}
    hook = DDPCompression(
        config,
        schedule=schedule,
        names=names,
        params=dict(model.module.named_parameters()),
        group=model.process_group,
        error_feedback=error_feedback,
        second_group=second_group,
        decision=decision,
    )
    if (
        hook._plain
    ):  # uncompressed: DDP's own all-reduce, counted (see [Note: the hook's own stream])
        hook.count_native(model)
    else:
        model.register_comm_hook(hook, _ddp_hook)
    if schedule.prediction == "local":  # [Note: prediction in the schedule]
        hook.predict = AutoPrediction(model, hook, clip=schedule.predict_clip)
    return hook


def _check_graphs(model: DDP, config, name: str, error_feedback: bool) -> None:
    """``Schedule(graphs=True)``'s conditions under DDP: CGX's two-phase all-reduce to replay
    ([Note: two phases replayed] in ``qsdp.comm._two_phase``), CUDA parameters, no error
    feedback (its losses are computed eagerly)."""
    if config == "auto" or not isinstance(config.grads, QuantizedGrads):
        what = name if config == "auto" else f"{name} ({type(config.grads).__name__})"
        raise ValueError(
            "Schedule(graphs=True) replays the codecs of CGX's two-phase all-reduce "
            f"(QuantizedGrads: 'cgx', 'qsdp-g8'); {what} has none to replay (Global-QSGD's "
            "integer all-reduce, uncompressed gradients, or a choice made at run time): drop "
            "graphs, or use 'cgx' or 'qsdp-g8'"
        )
    if error_feedback:
        raise ValueError(
            "Schedule(graphs=True) with error_feedback=True: error feedback's losses are "
            "computed eagerly: drop one of them"
        )
    qc.CodecGraphs.check_parameters(model.parameters())


def _auto(model: DDP, *, pipeline: bool) -> auto.AutoDecision:
    """``register(model, "auto")``: the policy's decision of DDP's all-reduce in its buckets,
    measured on DDP's group and this device's quantizers, printed on rank 0
    (qsdp.policy.auto)."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    size = params[0].element_size()  # DDP's gradients: the parameters' dtype
    cap = getattr(model, "bucket_bytes_cap", 25 * 2**20)
    buckets = max(1, -(-numel * size // cap))
    decision = auto.decide_all_reduce(
        model.process_group,
        params[0].device,
        numel=numel,
        buckets=buckets,
        element_size=size,
        pipeline=pipeline,
    )
    if dist.get_rank() == 0:
        print(decision.report(), flush=True)
    return decision


def _ddp_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks unannotated or exact types
    """The function DDP calls (it needs a named function); ``state`` is the model's
    :class:`DDPCompression`."""
    return state.reduce(bucket)
