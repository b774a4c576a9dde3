"""Typed configuration of what qsdp compresses, and the named recipes built from one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .policy import ParamPolicy
from .quant import CARRIERS, QuantSpec

__all__ = ["RECIPES", "CompressionConfig", "recipe"]


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """What crosses the wire in FSDP2's collectives; ``None`` leaves a collective uncompressed."""

    weights: QuantSpec | None = None
    """Quantizer of the parameter all-gather (every rank decodes every shard, its own too)."""
    grads: QuantSpec | None = None
    """Quantizer of the single-level gradient reduce-scatter (all-to-all, fp32 accumulation)."""
    grad_carrier: str | None = None
    """Global-QSGD integer reduce-scatter on this carrier (``int8``, ``fp16``, ``int32``);
    exclusive with ``grads``."""
    grads_inter: QuantSpec | None = None
    """Inter-node quantizer of SDP4Bit's two-level reduce-scatter (``grads`` is then the
    intra-node one); without a 2-D mesh every peer counts as remote and only this one runs."""
    grad_group_size: int = 128
    """Elements sharing one scale in the integer reduce-scatter."""
    weight_diffs: bool = False
    """SDP4Bit's qWD: ``weights`` quantizes the change since the last gather, against a
    reconstruction every rank keeps (param dtype, e.g. 2 bytes per parameter for bf16)."""
    quantized_master: bool = False
    """QSDP's theory setting: at each step's first gather the fp32 master shard is projected
    onto ``weights``' shift-lattice grid (stochastic rounding), so the all-gather is lossless
    with respect to the master: ``x_{t+1} = Q_w(x_t - lr * Q_g(g_t))``."""
    weight_resync_every: int = 0
    """With ``weight_diffs``: every this many difference gathers send full precision (0: only the
    first gather and after ``load_state_dict`` / :func:`qsdp.fsdp.resync`)."""
    grad_nonfinite: str = "raise"
    """NaN/Inf in a gradient about to be reduced: ``raise`` (every rank raises, naming the
    parameters; one small all-reduce per reduce-scatter), ``zero`` (that group's reduced gradient
    is zeroed for the step and counted), or ``propagate`` (no check: NaN groups travel as NaN)."""
    check_replicas: bool = False
    """With ``weight_diffs``: compare a checksum of the reconstructions across ranks after every
    gather and raise on divergence (one small all-reduce per gather)."""
    policy: ParamPolicy | None = ParamPolicy()
    """Parameters sent uncompressed (default: 1-D and under 1024 elements); ``None`` quantizes
    everything. Applies to quantized weights and gradients, not to weight differences (whose
    error feedback keeps small tensors accurate)."""
    seed: int = 0
    """Key of the stochastic-rounding noise, the same on every rank (streams differ by rank)."""

    def __post_init__(self) -> None:
        for name in ("weights", "grads", "grads_inter"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, QuantSpec):
                raise TypeError(f"CompressionConfig.{name} must be a QuantSpec or None")
        if self.grads is not None and self.grad_carrier is not None:
            raise ValueError(
                "CompressionConfig: set grads (quantized reduce-scatter) or grad_carrier "
                "(Global-QSGD integer reduce-scatter), not both"
            )
        if self.grads_inter is not None and self.grads is None:
            raise ValueError(
                "CompressionConfig.grads_inter (two-level gradients) needs grads, the intra-node "
                "quantizer"
            )
        if self.weight_diffs and self.weights is None:
            raise ValueError("CompressionConfig.weight_diffs needs weights, their quantizer")
        if self.quantized_master:
            if self.weights is None or self.weights.scheme.value != "shift-lattice":
                raise ValueError(
                    "CompressionConfig.quantized_master needs weights with scheme='shift-lattice' "
                    "(the grid the master lives on)"
                )
            if self.weight_diffs:
                raise ValueError("quantized_master and weight_diffs exclude each other")
        if not isinstance(self.weight_resync_every, int) or self.weight_resync_every < 0:
            raise ValueError(
                f"CompressionConfig.weight_resync_every={self.weight_resync_every!r} must be an "
                "int >= 0"
            )
        if self.grad_nonfinite not in ("raise", "zero", "propagate"):
            raise ValueError(
                f"CompressionConfig.grad_nonfinite={self.grad_nonfinite!r} must be 'raise', "
                "'zero' or 'propagate'"
            )
        if self.grad_carrier is not None and self.grad_carrier not in CARRIERS:
            raise ValueError(
                f"CompressionConfig.grad_carrier={self.grad_carrier!r} must be one of "
                f"{sorted(CARRIERS)}"
            )
        if self.policy is not None and not isinstance(self.policy, ParamPolicy):
            raise TypeError("CompressionConfig.policy must be a qsdp.policy.ParamPolicy or None")
        g = self.grad_group_size
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"CompressionConfig.grad_group_size={g!r} must be a positive int")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"CompressionConfig.seed={self.seed!r} must be an int in [0, 2**64)")


def _bf16() -> CompressionConfig:
    return CompressionConfig()


def _qsdp_w8g8() -> CompressionConfig:
    # QSDP: 8-bit weights (deterministic, the fp32 master shards stay exact) and 8-bit min-max
    # gradients with stochastic rounding (unbiased), groups of 128.
    return CompressionConfig(
        weights=QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest"),
        grads=QuantSpec(bits=8, group_size=128, scheme="minmax", rounding="stochastic"),
    )


def _qsdp_quantized_master() -> CompressionConfig:
    # QSDP's convergence theorem: the master weights live on an 8-bit randomly shifted lattice.
    base = _qsdp_w8g8()
    return CompressionConfig(
        weights=QuantSpec(bits=8, group_size=128, scheme="shift-lattice", rounding="stochastic"),
        grads=base.grads,
        quantized_master=True,
    )


def _global_qsgd() -> CompressionConfig:
    return CompressionConfig(grad_carrier="int8")


# SDP4Bit's quantizers: 4-bit weight differences in groups of 2048; gradients 8-bit intra-node
# and 4-bit inter-node in groups of 128, Hadamard-smoothed in blocks of 32.
_W4 = QuantSpec(bits=4, group_size=2048, scheme="absmax", rounding="stochastic")


def _tlq(hadamard: bool) -> dict:
    h = 32 if hadamard else None
    return dict(
        grads=QuantSpec(
            bits=8, group_size=128, scheme="absmax", rounding="stochastic", hadamard_block=h
        ),
        grads_inter=QuantSpec(
            bits=4, group_size=128, scheme="absmax", rounding="stochastic", hadamard_block=h
        ),
    )


def _w4_direct() -> CompressionConfig:
    # SDP4Bit's ablation: the same 4-bit quantizer applied to the weights themselves.
    return CompressionConfig(weights=_W4)


def _qwd_only() -> CompressionConfig:
    return CompressionConfig(weights=_W4, weight_diffs=True)


def _tlq_hs_only() -> CompressionConfig:
    return CompressionConfig(**_tlq(hadamard=True))


def _tlq_no_hadamard() -> CompressionConfig:
    return CompressionConfig(**_tlq(hadamard=False))


def _sdp4bit() -> CompressionConfig:
    return CompressionConfig(weights=_W4, weight_diffs=True, **_tlq(hadamard=True))


#: Named recipes.
RECIPES: dict[str, Callable[[], CompressionConfig]] = {
    "bf16": _bf16,
    "qsdp-w8g8": _qsdp_w8g8,
    "qsdp-quantized-master": _qsdp_quantized_master,
    "global-qsgd": _global_qsgd,
    "sdp4bit": _sdp4bit,
    "w4-direct": _w4_direct,
    "qwd-only": _qwd_only,
    "tlq-hs-only": _tlq_hs_only,
    "tlq-no-hadamard": _tlq_no_hadamard,
}


def recipe(name: str) -> CompressionConfig:
    """The :class:`CompressionConfig` of a named recipe (see :data:`RECIPES`)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name]()
