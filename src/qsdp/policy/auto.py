"""``recipe="auto"``: measure the link and the quantizers, price each named recipe's collectives
through their plans ([Note: the cost model] in ``qsdp.policy._cost``), pick the fastest per
collective, and say so in a typed :class:`AutoDecision`: printed, run, and kept in the
checkpoint.

    measure (_measure.py) -> predict_* / choose* (_cost.py) -> AutoDecision -> .config()
                                                                            -> .report(), .record()
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._cost import (
    _ALL_REDUCE,
    _GRADS,
    _WEIGHTS,
    MARGIN,
    WIRE_EXPOSED,
    _recipe_name,
    _sub_config,
    choose,
    choose_fsdp,
    predict_ddp,
    predict_fsdp,
    wire_bytes_ddp,
    wire_bytes_fsdp,
)
from ._measure import Measured, agree, measure

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..config import CompressionConfig

__all__ = [
    "MARGIN",
    "WIRE_EXPOSED",
    "AutoDecision",
    "Measured",
    "agree",
    "check_state_entry",
    "choose",
    "choose_fsdp",
    "decide_all_reduce",
    "decide_fsdp",
    "measure",
    "predict_ddp",
    "predict_fsdp",
    "saved_decision",
    "state_entry",
    "wire_bytes_ddp",
    "wire_bytes_fsdp",
]


# --- the decision -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AutoDecision:
    """What ``"auto"`` measured, predicted and chose: per collective for FSDP2 (``weights`` and
    ``grads``), one all-reduce for DDP and compressed HSDP (``all_reduce``).

    ``compress_fsdp(model, "auto")`` and ``qsdp.ddp.register(model, "auto")`` print
    :meth:`report` on rank 0, run :meth:`config` and keep the decision
    (``qsdp.fsdp.comm_state(model).decision``, the DDP hook's ``.decision``); FSDP2's checkpoint
    state keeps its :meth:`record` (:func:`state_entry`). A resumed run rebuilds the same config
    with ``AutoDecision.from_record(record).config()``.
    """

    weights: str | None = None
    """FSDP2's weight all-gathers: ``"none"``, ``"w8"`` or ``"wd4"`` (None: an all-reduce)."""
    grads: str | None = None
    """FSDP2's gradient reduce-scatters: ``"none"``, ``"g8"``, ``"g4"`` or ``"tl"``."""
    all_reduce: str | None = None
    """DDP's (compressed HSDP's) all-reduce: ``"bf16"``, ``"cgx"``, ``"qsdp-g8"`` or
    ``"global-qsgd"`` (None: FSDP2's collectives)."""
    pipeline: bool = False
    """Whether the integration pipelines the chosen all-reduce (``pipeline=True`` was asked)."""
    pipeline_off: str | None = None
    """Why ``pipeline=True`` was turned off (None: it was not)."""
    predicted_s: dict[str, dict[str, float]]
    """Predicted exposed seconds per step of each option, by collective (``"weights"`` and
    ``"grads"``, or ``"all_reduce"``): ``WIRE_EXPOSED`` of the wire, all of the codecs."""
    predicted_serial_s: dict[str, dict[str, float]]
    """The same with the whole wire counted (no compute to hide it behind)."""
    wire_bytes: dict[str, dict[str, int]]
    """Bytes per step this rank hands to ``torch.distributed`` for each option, by collective
    (the plans' ``*_wire_bytes``)."""
    measured: Measured
    """The link of the group the collectives run on (FSDP's shard group, DDP's, the replicas')."""
    levels: tuple[Measured, Measured] | None = None
    """A two-level mesh's (inter-node, intra-node) levels, measured apart."""

    def __post_init__(self) -> None:
        fsdp = (self.weights, self.grads) != (None, None)
        if fsdp == (self.all_reduce is not None) or (fsdp and None in (self.weights, self.grads)):
            raise ValueError(
                f"AutoDecision(weights={self.weights!r}, grads={self.grads!r}, "
                f"all_reduce={self.all_reduce!r}): give weights and grads (FSDP2) or all_reduce "
                "(DDP, compressed HSDP)"
            )
        known = {"weights": _WEIGHTS, "grads": _GRADS} if fsdp else {"all_reduce": _ALL_REDUCE}
        for part, options in known.items():
            if getattr(self, part) not in options:
                raise ValueError(
                    f"unknown 'auto' {part} option {getattr(self, part)!r}; known: "
                    f"{sorted(options)}"
                )
        if self.grads == "tl" and self.levels is None:
            raise ValueError("AutoDecision(grads='tl') reduces over two levels: give levels")
        if self.pipeline and self.pipeline_off is not None:
            raise ValueError(f"AutoDecision: pipeline=True but pipeline_off={self.pipeline_off!r}")

    @property
    def options(self) -> dict[str, str]:
        """The chosen option per collective."""
        if self.all_reduce is not None:
            return {"all_reduce": self.all_reduce}
        return {"weights": self.weights, "grads": self.grads}

    @property
    def two_level(self) -> bool:
        """Whether the gradients reduce over compress_fsdp's two-level mesh (``"tl"``); every
        other option ignores the mesh."""
        return self.grads == "tl"

    @property
    def recipe(self) -> str:
        """The named recipe of :meth:`config` (``"sdp4bit (two levels, 2 x 2)"`` over a mesh),
        or the options when no recipe is that config (``"weights=w8, grads=none"``)."""
        if self.all_reduce is not None:
            return self.all_reduce
        name = _recipe_name(self.config()) or f"weights={self.weights}, grads={self.grads}"
        if self.two_level:
            name += f" (two levels, {self.levels[0].world} x {self.levels[1].world})"
        return name

    def config(self) -> CompressionConfig:
        """The chosen :class:`qsdp.CompressionConfig`, built from the named recipes'
        sub-configs (for ``"tl"``: pass compress_fsdp the mesh; for the others, none)."""
        from ..config import CompressionConfig, recipe

        if self.all_reduce is not None:
            return recipe(self.all_reduce)
        weights = _WEIGHTS[self.weights]
        return CompressionConfig(
            weights=_sub_config(weights),
            grads=_sub_config(_GRADS[self.grads]),
        )  # (8-bit weights are gathered again in the backward: Schedule's default then
        # reduces on a communicator of its own, as for qsdp-w8g8)

    def record(self) -> dict:
        """The decision as JSON-able values (``config.json``, a checkpoint, a benchmark row):
        its fields, the recipe, and the measured links in GB/s and us for reading."""
        levels = None if self.levels is None else [_measured_record(v) for v in self.levels]
        return {
            "weights": self.weights,
            "grads": self.grads,
            "all_reduce": self.all_reduce,
            "recipe": self.recipe,
            "two_level": self.two_level,
            "pipeline": self.pipeline,
            "pipeline_off": self.pipeline_off,
            "predicted_s": self.predicted_s,
            "predicted_serial_s": self.predicted_serial_s,
            "wire_bytes": self.wire_bytes,
            "measured": _measured_record(self.measured),
            "levels": levels,
            "bus_gb_per_s": _gb_per_s(self.measured),
            "latency_us": self.measured.latency_s * 1e6,
            "levels_gb_per_s": None if self.levels is None else [_gb_per_s(v) for v in self.levels],
        }

    @classmethod
    def from_record(cls, record: dict) -> AutoDecision:
        """The decision :meth:`record` wrote (keys it derives, such as ``"recipe"``, and keys a
        caller added are not read).

        Raises:
            ValueError: a key of the decision is missing (a record of an older qsdp).
        """
        need = ("weights", "grads", "all_reduce", "pipeline", "pipeline_off", "predicted_s")
        need += ("predicted_serial_s", "wire_bytes", "measured", "levels")
        missing = [k for k in need if k not in record]
        if missing:
            raise ValueError(
                f"this 'auto' record lacks {missing} (it has {sorted(record)}): it was written "
                "by an older qsdp; resume with the recipe it ran instead"
            )
        levels = record["levels"]
        return cls(
            weights=record["weights"],
            grads=record["grads"],
            all_reduce=record["all_reduce"],
            pipeline=record["pipeline"],
            pipeline_off=record["pipeline_off"],
            predicted_s=record["predicted_s"],
            predicted_serial_s=record["predicted_serial_s"],
            wire_bytes=record["wire_bytes"],
            measured=_measured_from(record["measured"]),
            levels=None if levels is None else tuple(_measured_from(v) for v in levels),
        )

    def report(self) -> str:
        """What was measured, each option's predicted bytes and time per step, the choice and
        its exposed communication per step against uncompressed, and whether pipelining was
        turned off (the table ``"auto"`` prints on rank 0)."""
        m = self.measured
        link = (
            "no link (one rank)"
            if math.isinf(m.bytes_per_s)
            else (f"link {m.bytes_per_s / 1e9:.2f} GB/s bus, latency {m.latency_s * 1e6:.0f} us")
        )
        if self.levels is not None:
            inter, intra = (f"{v.world} ranks {_gb_per_s(v):.2f} GB/s" for v in self.levels)
            link += f" (inter-node {inter}, intra-node {intra})"
        lines = [
            f"qsdp auto: {m.world} ranks, {link}; predicted per step (exposed: {WIRE_EXPOSED:g} "
            "of each wire time and all codec time; serial: the whole wire):",
            f"  {'collective':<11} {'option':<12} {'MB sent':>10} {'exposed ms':>11} "
            f"{'serial ms':>10}",
        ]
        chosen = self.options
        for part, options in self.predicted_s.items():
            for name, seconds in sorted(options.items(), key=lambda kv: kv[1]):
                mark = "*" if chosen[part] == name else " "
                lines.append(
                    f"  {part:<11}{mark}{name:<12} {self.wire_bytes[part][name] / 1e6:>10.3f} "
                    f"{seconds * 1e3:>11.1f} {self.predicted_serial_s[part][name] * 1e3:>10.1f}"
                )
        plain = "bf16" if self.all_reduce is not None else "none"
        ms = sum(self.predicted_s[p][o] for p, o in chosen.items()) * 1e3
        plain_ms = sum(opts[plain] for opts in self.predicted_s.values()) * 1e3
        parts = "" if self.all_reduce else f" [weights {self.weights}, grads {self.grads}]"
        lines.append(
            f"chose {self.recipe}{parts}: {ms:.1f} ms of exposed communication per step "
            f"against {plain_ms:.1f} ms uncompressed (margin {MARGIN:g}; compute and overlap "
            "not modelled)"
        )
        if self.pipeline_off is not None:
            lines.append(f"pipeline=True turned off: {self.pipeline_off}")
        return "\n".join(lines)


def _gb_per_s(m: Measured) -> float | None:
    """A link's bus bandwidth in GB/s (None for a group of one rank: JSON has no infinity)."""
    return None if math.isinf(m.bytes_per_s) else m.bytes_per_s / 1e9


def _measured_record(m: Measured) -> dict:
    return {
        "world": m.world,
        "latency_s": m.latency_s,
        "bytes_per_s": None if math.isinf(m.bytes_per_s) else m.bytes_per_s,
        "codec_s_per_element": {str(b): t for b, t in m.codec_s_per_element.items()},
        "codec_s_per_call": {str(b): t for b, t in m.codec_s_per_call.items()},
    }


def _measured_from(record: dict) -> Measured:
    rate = record["bytes_per_s"]
    return Measured(
        latency_s=record["latency_s"],
        bytes_per_s=math.inf if rate is None else rate,
        codec_s_per_element={int(b): t for b, t in record["codec_s_per_element"].items()},
        world=record["world"],
        codec_s_per_call={int(b): t for b, t in record["codec_s_per_call"].items()},
    )


def decide_fsdp(
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    shards: Sequence[int],
    compute_bytes: int | Sequence[int] = 2,
    reduce_bytes: int | Sequence[int] = 4,
    mesh: DeviceMesh | None = None,
    pipeline: bool = False,
) -> AutoDecision:
    """FSDP2's ``"auto"``: measure ``group`` (FSDP's shard group) and, with a two-level
    ``mesh`` over it, each level apart; predict each option of the weights' all-gathers and the
    gradients' reduce-scatters for groups of ``shards[i]`` elements per rank; choose each.
    Collective over ``group`` (and the mesh's groups); every rank decides the same.

    Args:
        group: the shard group.
        device: where the quantizers are timed.
        shards, compute_bytes, reduce_bytes: as for :func:`predict_fsdp`.
        mesh: compress_fsdp's 2-D (inter-node, intra-node) mesh, or None.
        pipeline: the integration's ``pipeline`` argument, kept (FSDP2's reduce-scatters are
            not pipelined: compress_fsdp refuses it without ``replicate=``).

    Returns:
        The :class:`AutoDecision`.
    """
    measured = measure(group, device)
    levels = None
    if mesh is not None and min(mesh.shape) > 1:  # each level apart: two all-to-alls
        inter, intra = (measure(mesh.get_group(d), device) for d in (0, 1))
        levels = tuple(agree([inter, intra], group, device))
    inputs = {"levels": levels, "compute_bytes": compute_bytes, "reduce_bytes": reduce_bytes}
    predicted = predict_fsdp(shards, measured, **inputs)
    weights, grads = choose_fsdp(predicted)
    shape = None if levels is None else (levels[0].world, levels[1].world)
    return AutoDecision(
        weights=weights,
        grads=grads,
        pipeline=pipeline,
        predicted_s=predicted,
        predicted_serial_s=predict_fsdp(shards, measured, **inputs, wire_exposed=1.0),
        wire_bytes=wire_bytes_fsdp(
            shards,
            measured.world,
            levels=shape,
            compute_bytes=compute_bytes,
            reduce_bytes=reduce_bytes,
        ),
        measured=measured,
        levels=levels,
    )


def decide_all_reduce(
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    numel: int,
    buckets: int,
    element_size: int = 4,
    pipeline: bool = False,
) -> AutoDecision:
    """The recipe of a gradient all-reduce of ``numel`` elements of ``element_size`` bytes in
    ``buckets`` calls per step (DDP's buckets, compressed HSDP's replicate all-reduce): measure
    ``group``, predict each option, choose. Collective over ``group``; every rank decides the
    same.

    Args:
        pipeline: the integration's ``pipeline`` argument: kept when the choice compresses,
            turned off (and said, ``pipeline_off``) when it chose the uncompressed all-reduce.

    Returns:
        The :class:`AutoDecision`.
    """
    measured = measure(group, device)
    size = {"buckets": buckets, "element_size": element_size}
    predicted = predict_ddp(numel, measured, **size)
    choice = choose(predicted)
    off = None
    if pipeline and choice == "bf16":
        off = "auto chose the uncompressed all-reduce (bf16): nothing to pipeline"
    return AutoDecision(
        all_reduce=choice,
        pipeline=pipeline and off is None,
        pipeline_off=off,
        predicted_s={"all_reduce": predicted},
        predicted_serial_s={"all_reduce": predict_ddp(numel, measured, **size, wire_exposed=1.0)},
        wire_bytes={"all_reduce": wire_bytes_ddp(numel, measured.world, **size)},
        measured=measured,
    )


# --- the decision in a checkpoint ---------------------------------------------------------------
_ENTRY_BYTES = 8192
"""A checkpoint entry's size: a record's JSON takes ~1.5 KB."""


def state_entry(decision: AutoDecision | None) -> torch.Tensor:
    """The checkpoint entry of ``decision``: its :meth:`~AutoDecision.record` as JSON text in a
    uint8 tensor of a fixed size, zero-padded (all zeros: no decision, a named recipe). A
    tensor of one size whatever the decision, as ``qsdp.config.config_record``'s: every value
    of a state dict stays a tensor, and ``torch.distributed.checkpoint`` loads another run's
    entry into this one's (it loads only the keys, and shapes, the running model's state has).

    Raises:
        ValueError: the record's JSON exceeds the entry (8 KiB).
    """
    from ..config import text_entry  # (config imports this package: resolved at call time)

    if decision is None:
        return text_entry(b"", _ENTRY_BYTES)
    text = json.dumps(decision.record(), sort_keys=True).encode()
    if len(text) > _ENTRY_BYTES:
        raise ValueError(
            f"an 'auto' record of {len(text)} bytes does not fit a checkpoint entry of "
            f"{_ENTRY_BYTES}: raise qsdp.policy.auto._ENTRY_BYTES"
        )
    return text_entry(text, _ENTRY_BYTES)


def _entry_decision(entry: torch.Tensor) -> AutoDecision | None:
    from ..config import entry_text

    text = entry_text(entry)
    return AutoDecision.from_record(json.loads(text)) if text else None


def check_state_entry(
    entry: torch.Tensor | None, *, decision: AutoDecision | None, config: CompressionConfig
) -> None:
    """Check a loaded checkpoint's ``"auto"`` entry (:func:`state_entry`; None: a checkpoint
    without one) against what this model runs: ``decision`` (its own ``"auto"``'s), else
    ``config`` (a resumed run's, rebuilt from the record).

    Raises:
        ValueError: the saved decision chose other collectives (naming both).
    """
    saved = None if entry is None else _entry_decision(entry)
    if saved is None:
        return
    if decision is not None:
        if (saved.options, saved.two_level) == (decision.options, decision.two_level):
            return
        running = f"this model's 'auto' chose {decision.recipe} ({_options(decision)})"
    else:
        if saved.config() == config:
            return
        running = f"this model runs {_recipe_name(config) or repr(config)}"
    raise ValueError(
        f"this qsdp state was saved by a run whose 'auto' chose {saved.recipe} "
        f"({_options(saved)}); {running}: the collectives' state would not fit. "
        "Rebuild the saved choice (qsdp.policy.AutoDecision.from_record(record).config(), with "
        "the mesh if it chose two levels), or start the collectives afresh (load the model and "
        "optimizer without this state)"
    )


def saved_decision(state: dict) -> AutoDecision | None:
    """The decision a collectives' state dict (``qsdp.fsdp.comm_state(model).state_dict()``,
    the DDP hook's) keeps under ``"auto"``: what a run chose when it saved (None: a named
    recipe, or a state without the entry)."""
    entry = state.get("auto")
    return None if entry is None else _entry_decision(entry)


def _options(decision: AutoDecision) -> str:
    return ", ".join(f"{part}={option}" for part, option in decision.options.items())
