"""Typed configuration of what qsdp compresses, and the named recipes built from one place.

[Note: one sub-config per collective]
A :class:`CompressionConfig` says *what* crosses the wire, one sub-config per collective, and
never how: there is no flag whose meaning depends on another flag.

- ``weights`` (the parameter all-gather): ``None`` (uncompressed), :class:`QuantizedWeights`
  (QSDP's W8), :class:`WeightDiffs` (SDP4Bit's qWD) or :class:`QuantizedMaster` (QSDP's theory
  setting).
- ``grads`` (the gradient reduce-scatter of FSDP2, the all-reduce of DDP and of HSDP's replicate
  dimension): ``None``, :class:`QuantizedGrads` (QSDP, CGX), :class:`TwoLevelGrads` (SDP4Bit's
  TLq-HS, reduce-scatter only) or :class:`IntegerGrads` (Global-QSGD).

Each gradient sub-config builds its own :class:`qsdp.comm.ReducePlan` (``grads.plan(...)``),
which every integration runs; plans leave NaN/Inf to the integration, which checks each
reduction once as ``nonfinite`` says. ``recipe(name, **overrides)`` gives the named recipes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import IntegerReduce, QuantizedReduce, ReducePlan, TwoLevelReduce
from .policy import ParamPolicy
from .quant import BITS, CARRIERS, NonFinite, QuantSpec, Rounding

__all__ = [
    "RECIPES",
    "AdaptiveWidths",
    "CompressionConfig",
    "IntegerGrads",
    "NonFinite",
    "QuantizedGrads",
    "QuantizedMaster",
    "QuantizedWeights",
    "Schedule",
    "TwoLevelGrads",
    "WeightDiffs",
    "recipe",
]


def _check_spec(owner: str, name: str, spec: object) -> None:
    if not isinstance(spec, QuantSpec):
        raise TypeError(
            f"{owner}.{name} must be a qsdp.QuantSpec, got {type(spec).__name__}; e.g. "
            "QuantSpec(bits=8, group_size=128, scheme='absmax', rounding='nearest')"
        )


# --- weights: the parameter all-gather ---------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class QuantizedWeights:
    """Gather the weights as codes; every rank decodes every shard, its own included (QSDP)."""

    spec: QuantSpec
    """The weights' quantizer."""

    def __post_init__(self) -> None:
        _check_spec("QuantizedWeights", "spec", self.spec)


@dataclass(frozen=True, kw_only=True)
class WeightDiffs:
    """SDP4Bit's qWD: gather the change since the last gather, against a reconstruction every
    rank keeps (param dtype: 2 bytes per bf16 parameter)."""

    spec: QuantSpec
    """The differences' quantizer (SDP4Bit: 4-bit absmax, groups of 2048, stochastic)."""
    resync_every: int = 0
    """Every this many difference gathers send full precision (0: only the first gather and
    after ``load_state_dict`` / :func:`qsdp.fsdp.resync`)."""
    check_replicas: bool = False
    """Compare a checksum of the reconstructions across ranks after every gather and raise on
    divergence (one small all-reduce per gather)."""

    def __post_init__(self) -> None:
        _check_spec("WeightDiffs", "spec", self.spec)
        if not isinstance(self.resync_every, int) or self.resync_every < 0:
            raise ValueError(
                f"WeightDiffs.resync_every={self.resync_every!r} must be an int >= 0 (0: never)"
            )


@dataclass(frozen=True, kw_only=True)
class QuantizedMaster:
    """QSDP's theory setting: at each step's first gather the fp32 master shard is projected
    onto the weights' shift-lattice (stochastic rounding), so the gather is lossless with
    respect to the master: ``x_{t+1} = Q_w(x_t - lr * Q_g(g_t))``."""

    spec: QuantSpec
    """The lattice; ``scheme="shift-lattice"``."""

    def __post_init__(self) -> None:
        _check_spec("QuantizedMaster", "spec", self.spec)
        if self.spec.scheme.value != "shift-lattice":
            raise ValueError(
                f"QuantizedMaster.spec has scheme={self.spec.scheme.value!r}; the master lives "
                "on a grid: use scheme='shift-lattice'"
            )


Weights = QuantizedWeights | WeightDiffs | QuantizedMaster


# --- gradients: the reduce-scatter (FSDP2) or all-reduce (DDP, HSDP replicas) -----------------
@dataclass(frozen=True, kw_only=True)
class QuantizedGrads:
    """Codes through an all-to-all, summed in float32 on the receiver (QSDP, CGX); as an
    all-reduce, CGX's two phases (reduce-scatter, then all-gather of the re-encoded sums)."""

    spec: QuantSpec
    """The gradients' quantizer (stochastic rounding keeps the sum unbiased)."""

    def __post_init__(self) -> None:
        _check_spec("QuantizedGrads", "spec", self.spec)

    def plan(self, *, mesh: DeviceMesh | None = None) -> ReducePlan:
        """The :class:`~qsdp.comm.QuantizedReduce` of this config (``mesh`` is unused)."""
        return QuantizedReduce(spec=self.spec.propagating())  # the integration checks NaN/Inf


@dataclass(frozen=True, kw_only=True)
class TwoLevelGrads:
    """SDP4Bit's TLq-HS reduce-scatter over a 2-D (inter-node, intra-node) mesh; without a
    mesh every peer counts as remote and only ``inter`` runs."""

    intra: QuantSpec
    """The intra-node quantizer (SDP4Bit: 8 bits, group 128, Hadamard 32)."""
    inter: QuantSpec
    """The inter-node quantizer (SDP4Bit: 4 bits); same group size and Hadamard block."""

    def __post_init__(self) -> None:
        _check_spec("TwoLevelGrads", "intra", self.intra)
        _check_spec("TwoLevelGrads", "inter", self.inter)
        for field in ("group_size", "hadamard_block", "hadamard_seed"):
            a, b = getattr(self.intra, field), getattr(self.inter, field)
            if a != b:
                raise ValueError(
                    f"TwoLevelGrads: intra.{field}={a!r} and inter.{field}={b!r} differ; the "
                    "middle hop re-encodes group by group in one Hadamard domain"
                )

    def plan(self, *, mesh: DeviceMesh | None = None) -> ReducePlan:
        """The :class:`~qsdp.comm.TwoLevelReduce` of this config over ``mesh``."""
        return TwoLevelReduce(
            intra=self.intra.propagating(), inter=self.inter.propagating(), mesh=mesh
        )


@dataclass(frozen=True, kw_only=True)
class IntegerGrads:
    """Global-QSGD: integer codes on a global scale (one MAX all-reduce), summed exactly by the
    backend's plain SUM on a narrow carrier."""

    carrier: str = "int8"
    """``"int8"`` (up to 127 ranks), ``"fp16"`` (integers exact to 2048) or ``"int32"``."""
    group_size: int = 128
    """Elements sharing one scale."""
    rounding: Rounding | str = Rounding.STOCHASTIC
    """``stochastic`` (unbiased) or ``nearest``."""

    def __post_init__(self) -> None:
        if self.carrier not in CARRIERS:
            raise ValueError(
                f"IntegerGrads.carrier={self.carrier!r} must be one of {sorted(CARRIERS)}"
            )
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise ValueError(f"IntegerGrads.group_size={g!r} must be a positive int; try 128")
        try:
            object.__setattr__(self, "rounding", Rounding(self.rounding))
        except ValueError:
            raise ValueError(
                f"IntegerGrads.rounding={self.rounding!r} must be 'stochastic' or 'nearest'"
            ) from None

    def plan(self, *, mesh: DeviceMesh | None = None) -> ReducePlan:
        """The :class:`~qsdp.comm.IntegerReduce` of this config; NaN/Inf travel as such (the
        integration checks them once, see ``CompressionConfig.nonfinite``)."""
        return IntegerReduce(
            carrier=self.carrier,
            group_size=self.group_size,
            rounding=self.rounding,
            nonfinite="propagate",
        )


Grads = QuantizedGrads | TwoLevelGrads | IntegerGrads


# --- adaptive widths -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AdaptiveWidths:
    """Layer-wise adaptive gradient widths (CGX): every ``every`` reducing steps, first after
    ``warmup``, measure each reduction group's quantization error on its real gradients at each
    of ``widths`` and give each group the width that minimises the bytes with the total error
    at most the uniform config width's (``qsdp.policy.adaptive``, [Note: choosing widths])."""

    every: int = 500
    """Steps (backwards that reduce) between decisions."""
    warmup: int = 50
    """The first decision's step (after DDP's bucket rebuild and the first steps' transient):
    until then every group keeps the config's width, so a run shorter than ``warmup`` reducing
    steps never adapts (e.g. 20 steps with ``every=5`` change nothing; ``warmup=0`` decides at
    the first step). ``qsdp train`` takes ``min(50, steps // 10)``."""
    widths: tuple[int, ...] = BITS
    """The widths a group may take: any of those the payload format packs (2, 3, 4, 6, 8)."""
    sample: int = 1 << 16
    """Elements per group the error is measured on (whole quantization groups)."""
    per_parameter: bool = False
    """A width per parameter tensor (CGX's layers) instead of per reduction group (an FSDP2
    block): each group then reduces once per width it holds (its parameters of one width
    together, the raw ones with the first). FSDP2's synchronous reduce-scatter only."""
    error: str = "absolute"
    """What the budget counts: ``"absolute"``, each group's squared error (CGX's; the SGD
    view), or ``"relative"``, each group's squared error over its mean squared gradient (an
    Adam-like optimizer divides each coordinate by its gradient's scale, so a group with small
    gradients does not tolerate more absolute error)."""

    def __post_init__(self) -> None:
        if self.error not in ("absolute", "relative"):
            raise ValueError(
                f"AdaptiveWidths.error={self.error!r} must be 'absolute' or 'relative'"
            )
        if not isinstance(self.per_parameter, bool):
            raise ValueError(f"AdaptiveWidths.per_parameter={self.per_parameter!r} must be a bool")
        for name in ("every", "sample"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"AdaptiveWidths.{name}={v!r} must be a positive int")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"AdaptiveWidths.warmup={self.warmup!r} must be an int >= 0")
        widths = tuple(self.widths)
        if not widths or any(w not in BITS for w in widths) or len(set(widths)) < len(widths):
            raise ValueError(
                f"AdaptiveWidths.widths={self.widths!r} must be distinct widths among {BITS} "
                "(the payload format packs no others)"
            )
        object.__setattr__(self, "widths", tuple(sorted(widths)))


# --- the whole config -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """What crosses the wire in data-parallel training; ``None`` leaves a collective alone.

    See [Note: one sub-config per collective].
    """

    weights: Weights | None = None
    """The parameter all-gather (FSDP2): ``QuantizedWeights``, ``WeightDiffs``,
    ``QuantizedMaster`` or None."""
    grads: Grads | None = None
    """The gradient reduction: ``QuantizedGrads``, ``TwoLevelGrads``, ``IntegerGrads`` or
    None."""
    nonfinite: NonFinite | str = NonFinite.RAISE
    """NaN/Inf in a gradient about to be reduced: ``raise`` (the reduction's gradients are
    zeroed on the device when the backward ends, and every rank raises, naming the parameters,
    when the next backward ends or at ``check_nonfinite()``; one small all-reduce per backward),
    ``zero`` (zeroed the same way, and counted) or ``propagate`` (no check: NaN groups travel as
    NaN). See [Note: the verdict read one backward later] in ``qsdp.runtime.nonfinite``."""
    policy: ParamPolicy | None = ParamPolicy()
    """Parameters sent uncompressed (default: 1-D and under 1024 elements); ``None`` quantizes
    everything. Applies to quantized weights and gradients, not to weight differences (whose
    error feedback keeps small tensors accurate)."""
    seed: int = 0
    """Key of the stochastic-rounding noise, the same on every rank (streams differ by rank)."""
    adaptive: AdaptiveWidths | None = None
    """Adaptive widths of the gradient quantizer (``QuantizedGrads``; ``TwoLevelGrads``: its
    inter-node width); the config's width is the reference whose total error a plan may not
    exceed. FSDP2 reduce-scatter and DDP all-reduce."""

    def __post_init__(self) -> None:
        if self.weights is not None and not isinstance(self.weights, Weights):
            raise TypeError(
                f"CompressionConfig.weights={self.weights!r} must be QuantizedWeights, "
                "WeightDiffs, QuantizedMaster or None; e.g. weights=QuantizedWeights(spec=...)"
            )
        if self.grads is not None and not isinstance(self.grads, Grads):
            raise TypeError(
                f"CompressionConfig.grads={self.grads!r} must be QuantizedGrads, "
                "TwoLevelGrads, IntegerGrads or None; e.g. grads=IntegerGrads(carrier='int8')"
            )
        try:
            object.__setattr__(self, "nonfinite", NonFinite(self.nonfinite))
        except ValueError:
            raise ValueError(
                f"CompressionConfig.nonfinite={self.nonfinite!r} must be 'raise', 'zero' or "
                "'propagate'"
            ) from None
        if self.policy is not None and not isinstance(self.policy, ParamPolicy):
            raise TypeError("CompressionConfig.policy must be a qsdp.policy.ParamPolicy or None")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"CompressionConfig.seed={self.seed!r} must be an int in [0, 2**64)")
        if self.adaptive is not None:
            if not isinstance(self.adaptive, AdaptiveWidths):
                raise TypeError("CompressionConfig.adaptive must be a qsdp.AdaptiveWidths or None")
            spec = (
                self.grads.spec
                if isinstance(self.grads, QuantizedGrads)
                else self.grads.inter
                if isinstance(self.grads, TwoLevelGrads)
                else None
            )
            if spec is None:
                raise ValueError(
                    f"CompressionConfig.adaptive needs quantized gradients (QuantizedGrads or "
                    f"TwoLevelGrads) whose width can vary; grads={type(self.grads).__name__}"
                )
            if spec.bits not in self.adaptive.widths:
                raise ValueError(
                    f"AdaptiveWidths.widths={self.adaptive.widths} must include the gradients' "
                    f"own width {spec.bits}: it is the reference a plan may not be worse than"
                )

    @property
    def two_level(self) -> bool:
        """Whether the gradients want a 2-D (inter-node, intra-node) mesh."""
        return isinstance(self.grads, TwoLevelGrads)


# --- when and where it crosses ----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Schedule:
    """When, and on which communicators, a config's collectives run; never what crosses the
    wire (that is :class:`CompressionConfig`).

    [Note: what and when]
    A :class:`CompressionConfig` says what each collective sends (quantizers, policy, NaN/Inf
    handling, seed): two ranks must agree on it to decode each other, a checkpoint records it.
    A ``Schedule`` says when the reductions run (synchronously or one step late) and on which
    communicators (FSDP2's own or a second one; one or two for an all-reduce's exchanges). The
    same config runs under any schedule, and the same schedule under any config: ``"auto"``
    picks a config, never a schedule (it only turns ``pipeline`` off, and says so, when it
    picks uncompressed gradients).
    """

    staleness: int = 0
    """``1``: each step applies the previous step's reduced gradient while its own gradient's
    reduction overlaps the next step (bounded staleness, the elastic-consistency seed); ``0``:
    synchronous. One implementation for DDP, FSDP2 and compressed HSDP ([Note: one staleness
    core] in ``qsdp.runtime.delayed``); ``qsdp.StalenessGate`` bounds it."""
    own_reduce_group: bool | None = None
    """FSDP2: run the gradient reduce-scatters on a communicator of their own (a second
    process group over FSDP's ranks). NCCL runs one communicator's collectives in issue order,
    so on FSDP2's group a reduce-scatter and the next block's weight all-gather (FSDP2
    re-gathers in the backward) queue behind each other; on two they share a full-duplex link.
    Costs one more communicator's NCCL buffers. ``None`` (default): on when the weights are
    gathered again in the backward (``QuantizedWeights``, ``QuantizedMaster``: 4x H200 over
    sockets 0.983 s against 1.217 s per step of the 1.42 B GPT with ``qsdp-w8g8``; on NVLink
    5% slower, where ``auto`` keeps compression off). Staleness 1 always does it."""
    start: int | str = "auto"
    """Staleness 1: when the delayed schedule starts. ``"auto"`` (default): the first
    backwards run synchronously until the gradient norm has settled, then the delayed schedule
    starts ([Note: when staleness 1 starts] in ``qsdp.runtime.stale_start``); an int ``k``: after
    ``k`` synchronous backwards, ``0`` from the first. The backward that starts it applies
    nothing (``applied_nothing``)."""
    predict: str | None = None
    """Staleness 1: ``"local"`` computes each delayed step's gradient at the parameters Adam's
    (AdamW's) next step would reach with each rank's own gradient of the step in flight, with
    no change to the loop ([Note: prediction in the schedule] in ``qsdp.runtime.prediction``;
    the README loop's ``WeightPrediction(optimizer, local=state)`` on hooks, the same bits);
    ``"none"``: the delayed gradient as it is; ``None`` (default): ``"local"`` at staleness 1
    (an optimizer other than Adam or AdamW is refused at its first step: pass ``"none"``).
    Measured on GPT-125M: the delay as it is +19-30% of final loss, this prediction +0.6-1.9%
    (docs/recipes.md)."""
    predict_clip: float | None = None
    """``predict="local"``: clip each rank's estimate as ``clip_grad_norm_(max_norm=...)`` clips
    the gradient (pass the loop's own clipping norm), None: unclipped."""
    gather_ahead: bool = False
    """Staleness 1 with weight differences (``sdp4bit``) under FSDP2: gather the next step's
    weights in this step's backward, beside the gradients' reductions, instead of in the next
    forward ([Note: the next step's weights in this backward] in ``qsdp.runtime.gathered``):
    each group's weights for step ``t + 1`` are the optimizer's coming step (with the gradient
    the backward has just applied) and the prediction from there (with this rank's gradient
    now in flight), gathered once the group's backward is done; the next forward is served
    from them. The weights gathered ahead miss what the loop does to the gradients or the
    learning rate between the backward and ``optimizer.step()`` (clipping, a scheduler's
    change): the next gather corrects them, as it corrects a prediction. Needs
    ``predict="local"`` without ``predict_clip``, an Adam or AdamW."""
    pipeline: bool = False
    """Compressed HSDP (``replicate=``) and DDP: the compressed all-reduce's later exchange
    (CGX's phase 2, Global-QSGD's SUM) on a second communicator and the hooks on two
    alternating streams, so one module's (bucket's) exchange overlaps the next one's; the same
    bits. Not with staleness 1 under FSDP2 (its reductions overlap already)."""
    graphs: bool = False
    """FSDP2 on CUDA: replay the codec of each group's gradient reduce-scatter and weight
    all-gather (the encode before the exchange, the decode after it) from CUDA graphs
    captured at its first call: the same bits, a few host operations a call where the eager
    codec issues 6-40 ([Note: codec segments replayed] in ``qsdp.comm._graphs``). For a step
    bound by the host (a fast link, or 2 nodes x 2 at staleness 1). Replays a quantized
    reduce-scatter of one level (``qsdp-w8g8``, ``cgx``, ``sdp4bit`` without a node mesh) or
    two (``sdp4bit`` over a node mesh, [Note: two levels replayed] in ``qsdp.comm._two_level``),
    at staleness 1 too (the delayed reductions replayed on their side streams),
    ``QuantizedWeights`` gathers (``qsdp-w8g8``) and the weight-difference gathers
    (``sdp4bit``; their exact first gather and resyncs run eagerly); integer codes and HSDP's
    all-reduce run eagerly, as does a group whose parameters hold several adaptive widths.
    Costs about two of a group's gradients (and one gathered group, or one shard for weight
    differences) of device memory per shape and stream (staleness 1's two side streams each
    their own), the buffers shared by the groups of one shape, and two copies a call on the
    device; so only the FSDP modules whose shapes another one shares replay (a model's
    repeated blocks), the root's embedding and head run eagerly ([Note: only repeated shapes
    replayed] in ``qsdp.fsdp.api``; a model with no repeated module is refused). DDP on CUDA
    (``staleness=0``): CGX's two-phase all-reduce of each bucket (``cgx``,
    ``qsdp-g8``; not with error feedback) replays both phases' codecs ([Note: two phases
    replayed] in ``qsdp.comm._two_phase``) from the second backward on: about three buckets of
    device memory per bucket shape and hook stream (DDP's buckets rarely share a length: about
    three times the gradients, +10 B per parameter measured)."""

    def __post_init__(self) -> None:
        if self.staleness not in (0, 1) or isinstance(self.staleness, bool):
            raise ValueError(
                f"Schedule.staleness={self.staleness!r} must be 0 (synchronous) or 1 (apply the "
                "previous step's gradient while this step's reduction overlaps the next step)"
            )
        if self.start != "auto" and (
            isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0
        ):
            raise ValueError(
                f"Schedule.start={self.start!r} must be 'auto' (synchronous until the gradient "
                "norm settles) or the number of synchronous steps first (0: delayed from the start)"
            )
        if self.start not in ("auto", 0) and not self.staleness:
            raise ValueError(
                f"Schedule.start={self.start!r} is when staleness 1 starts; with staleness=0 "
                "every step is synchronous: drop start, or set staleness=1"
            )
        if self.predict not in (None, "none", "local"):
            raise ValueError(
                f"Schedule.predict={self.predict!r} must be 'local' (each delayed gradient "
                "computed at Adam's next step from each rank's own gradient), 'none' or None "
                "(the default: 'local' at staleness 1)"
            )
        if self.predict == "local" and not self.staleness:
            raise ValueError(
                f"Schedule.predict={self.predict!r} predicts where a delayed gradient lands; "
                "with staleness=0 nothing is delayed: drop predict, or set staleness=1"
            )
        if self.predict_clip is not None and (
            isinstance(self.predict_clip, bool)
            or not isinstance(self.predict_clip, (int, float))
            or not self.predict_clip > 0
        ):
            raise ValueError(
                f"Schedule.predict_clip={self.predict_clip!r} must be a positive number (the "
                "loop's gradient-clipping norm) or None"
            )
        if self.predict_clip is not None and self.prediction == "none":
            raise ValueError(
                "Schedule.predict_clip clips the prediction's estimate; with "
                f"predict={self.predict!r} at staleness={self.staleness} there is none: drop "
                "predict_clip, or set staleness=1 and predict='local'"
            )
        if not isinstance(self.gather_ahead, bool):
            raise TypeError(f"Schedule.gather_ahead={self.gather_ahead!r} must be a bool")
        if self.gather_ahead and self.prediction != "local":
            raise ValueError(
                "Schedule(gather_ahead=True) gathers the predicted weights of the next step; "
                f"with staleness={self.staleness} and predict={self.predict!r} there is no "
                "prediction: set staleness=1 and predict='local' (the default), or drop "
                "gather_ahead"
            )
        if self.gather_ahead and self.predict_clip is not None:
            raise ValueError(
                f"Schedule(gather_ahead=True) with predict_clip={self.predict_clip!r}: the "
                "weights are gathered block by block in the backward, before the estimate's "
                "whole norm is known; drop predict_clip or gather_ahead"
            )
        if self.own_reduce_group is not None and not isinstance(self.own_reduce_group, bool):
            raise TypeError(
                f"Schedule.own_reduce_group={self.own_reduce_group!r} must be a bool or None"
            )
        if not isinstance(self.pipeline, bool):
            raise TypeError(f"Schedule.pipeline={self.pipeline!r} must be a bool")
        if not isinstance(self.graphs, bool):
            raise TypeError(f"Schedule.graphs={self.graphs!r} must be a bool")

    @property
    def prediction(self) -> str:
        """The prediction that runs: ``"local"`` or ``"none"`` (:attr:`predict` resolved)."""
        if not self.staleness or self.predict == "none":
            return "none"
        return "local"

    def own_group(self, config: CompressionConfig) -> bool:
        """Whether ``config``'s FSDP2 reduce-scatters run on their own communicator
        (:attr:`own_reduce_group`, or its default for this config)."""
        if self.staleness:
            return True
        if self.own_reduce_group is not None:
            return self.own_reduce_group
        return isinstance(config.weights, (QuantizedWeights, QuantizedMaster))


def as_schedule(schedule: object, *, where: str) -> Schedule:
    """``schedule=`` of an integration (``where``: its name) as a :class:`Schedule` (None: the
    default one)."""
    if schedule is None:
        return Schedule()
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"{where}(schedule=...) takes a qsdp.Schedule, got {type(schedule).__name__}; e.g. "
            "schedule=qsdp.Schedule(staleness=1)"
        )
    return schedule


# --- the recipes ----------------------------------------------------------------------------
# QSDP: 8-bit weights (deterministic, the fp32 master shards stay exact) and 8-bit min-max
# gradients with stochastic rounding (unbiased), groups of 128.
_W8 = QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest")
_G8 = QuantSpec(bits=8, group_size=128, scheme="minmax", rounding="stochastic")
# SDP4Bit's quantizers: 4-bit weight differences in groups of 2048; gradients 8-bit intra-node
# and 4-bit inter-node in groups of 128, Hadamard-smoothed in blocks of 32.
_W4 = QuantSpec(bits=4, group_size=2048, scheme="absmax", rounding="stochastic")


def _tlq(hadamard: bool) -> TwoLevelGrads:
    h = 32 if hadamard else None
    return TwoLevelGrads(
        intra=QuantSpec(
            bits=8, group_size=128, scheme="absmax", rounding="stochastic", hadamard_block=h
        ),
        inter=QuantSpec(
            bits=4, group_size=128, scheme="absmax", rounding="stochastic", hadamard_block=h
        ),
    )


#: Named recipes: what each compresses (``qsdp.recipe(name)`` builds one).
RECIPES: dict[str, Callable[[], CompressionConfig]] = {
    "bf16": lambda: CompressionConfig(),
    # QSDP re-gathers its weights in the backward: its reduce-scatters run on a communicator
    # of their own by default (Schedule.own_reduce_group)
    "qsdp-w8g8": lambda: CompressionConfig(
        weights=QuantizedWeights(spec=_W8), grads=QuantizedGrads(spec=_G8)
    ),
    # QSDP's convergence theorem: the master weights live on an 8-bit randomly shifted lattice.
    "qsdp-quantized-master": lambda: CompressionConfig(
        weights=QuantizedMaster(
            spec=QuantSpec(bits=8, group_size=128, scheme="shift-lattice", rounding="stochastic")
        ),
        grads=QuantizedGrads(spec=_G8),
    ),
    "qsdp-g8": lambda: CompressionConfig(grads=QuantizedGrads(spec=_G8)),
    # CGX: 4-bit min-max gradients, stochastic rounding (QSGD's), in groups (CGX's "buckets") of
    # 256. CGX's library defaults to 512 and its examples use 1024; in the convergence study
    # (GPT-125M, 23 M tokens, DDP on 4 GPUs) 1024 missed DDP bf16's loss by +0.87-0.91% and 512
    # by +0.52-0.60%, 256 came within +0.09-0.43% (four runs), for 4.6% more bytes than 1024
    # (docs/results.md, "Convergence"). group_size=1024 gives CGX's examples' setting.
    "cgx": lambda: CompressionConfig(
        grads=QuantizedGrads(
            spec=QuantSpec(bits=4, group_size=256, scheme="minmax", rounding="stochastic")
        )
    ),
    "global-qsgd": lambda: CompressionConfig(grads=IntegerGrads(carrier="int8")),
    "sdp4bit": lambda: CompressionConfig(weights=WeightDiffs(spec=_W4), grads=_tlq(True)),
    # SDP4Bit's ablations: the same 4-bit quantizer on the weights themselves; each half alone.
    "w4-direct": lambda: CompressionConfig(weights=QuantizedWeights(spec=_W4)),
    "qwd-only": lambda: CompressionConfig(weights=WeightDiffs(spec=_W4)),
    "tlq-hs-only": lambda: CompressionConfig(grads=_tlq(True)),
    "tlq-no-hadamard": lambda: CompressionConfig(grads=_tlq(False)),
}


def recipe(name: str, **overrides: object) -> CompressionConfig:
    """The :class:`CompressionConfig` of a named recipe (see :data:`RECIPES`), with any field
    replaced, e.g. ``qsdp.recipe("sdp4bit", seed=3, nonfinite="zero")``."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    base = RECIPES[name]()
    fields = {f.name for f in dataclasses.fields(CompressionConfig)}
    unknown = sorted(set(overrides) - fields)
    moved = sorted(set(unknown) & {f.name for f in dataclasses.fields(Schedule)})
    if moved:
        shown = ", ".join(f"{k}={overrides[k]!r}" for k in moved)
        raise TypeError(
            f"recipe({name!r}, {shown}): {', '.join(moved)} says when the collectives run, not "
            f"what crosses the wire ([Note: what and when]): pass schedule=qsdp.Schedule({shown})"
            " to compress_fsdp or qsdp.ddp.register"
        )
    if unknown:
        raise TypeError(
            f"recipe({name!r}) got unknown overrides {unknown}; CompressionConfig has "
            f"{sorted(fields)}"
        )
    return dataclasses.replace(base, **overrides) if overrides else base


def describe(config: CompressionConfig, schedule: Schedule | None = None) -> str:
    """``config`` as a checkpoint records it: the named recipe it equals (with the fields that
    differ from it) or its full ``repr``, and ``schedule``'s staleness (what a checkpoint's
    state depends on: the reductions in flight). Two are the same exactly when their
    descriptions are (see :func:`check_saved`)."""
    text = _describe(config)
    return text + " at staleness 1" if schedule is not None and schedule.staleness else text


def _describe(config: CompressionConfig) -> str:
    for name, build in RECIPES.items():
        base = build()
        if base.weights == config.weights and base.grads == config.grads:
            extra = ", ".join(
                f"{f.name}={getattr(config, f.name)!r}"
                for f in sorted(dataclasses.fields(CompressionConfig), key=lambda f: f.name)
                if getattr(config, f.name) != getattr(base, f.name)
            )
            return f"recipe {name!r}" + (f" with {extra}" if extra else "")
    return repr(config)


_RECORD_BYTES = 512


def text_entry(text: bytes, size: int) -> torch.Tensor:
    """``text`` as a checkpoint entry: a uint8 tensor of ``size`` bytes, zero-padded. One size
    whatever the text, so that ``torch.distributed.checkpoint`` loads another run's entry into
    this one's (it loads the keys and shapes the running state has)."""
    if len(text) > size:
        raise ValueError(f"a checkpoint entry of {len(text)} bytes does not fit {size}")
    out = torch.zeros(size, dtype=torch.uint8)
    if text:  # (torch.frombuffer refuses an empty buffer)
        out[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out


def entry_text(entry: torch.Tensor) -> bytes:
    """The text of a :func:`text_entry` (its zero padding dropped)."""
    return bytes(entry.detach().cpu().to(torch.uint8).reshape(-1).tolist()).rstrip(b"\0")


def config_record(config: CompressionConfig, schedule: Schedule | None = None) -> torch.Tensor:
    """:func:`describe` of ``config`` as a checkpoint keeps it: a uint8 tensor of a fixed
    size (so that another config's record loads into it and :func:`check_saved` can say what
    was saved): the description's UTF-8 bytes (cut at 504) and, in the last 8, a digest of the
    whole description."""
    text = describe(config, schedule).encode()
    shown = text_entry(text[: _RECORD_BYTES - 8], _RECORD_BYTES - 8)
    digest = torch.frombuffer(bytearray(hashlib.sha256(text).digest()[:8]), dtype=torch.uint8)
    return torch.cat([shown, digest])


def check_saved(
    saved: torch.Tensor,
    config: CompressionConfig,
    schedule: Schedule | None = None,
    *,
    what: str,
) -> None:
    """Raise ``ValueError`` unless a checkpoint's record (``saved``, from
    :func:`config_record`) is ``config``'s: its counters, widths and reductions in flight
    belong to that config's collectives."""
    mine = config_record(config, schedule)
    saved = saved.detach().cpu().to(torch.uint8).reshape(-1)
    if saved.numel() == mine.numel() and torch.equal(saved[-8:], mine[-8:]):
        return
    shown = entry_text(saved[:-8]).decode(errors="replace")
    raise ValueError(
        f"{what}: this checkpoint's qsdp state was saved with {shown}; the model is "
        f"compressed with {describe(config, schedule)}. Compress the model as it was when "
        "saved, or load the model and optimizer without the qsdp state (the run then draws "
        "new stochastic-rounding noise)"
    )
