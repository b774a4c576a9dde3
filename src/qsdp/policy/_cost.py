"""``"auto"``'s cost model: each named recipe's collectives priced through their plans'
``*_wire_bytes``, and the choice of the fastest per collective.

[Note: the cost model]
The options are the named recipes' sub-configs, one definition of each (``_WEIGHTS``,
``_GRADS``, ``_ALL_REDUCE``): FSDP2's weight all-gathers uncompressed (``"none"``), QSDP's 8-bit
weights (``"w8"``, ``qsdp-w8g8``'s ``QuantizedWeights``, gathered in the forward and again in the
backward) or SDP4Bit's 4-bit weight differences (``"wd4"``, ``sdp4bit``'s ``WeightDiffs`` in
groups of 2048, gathered once: the backward reuses the reconstruction); its gradient
reduce-scatters uncompressed, 8-bit (``"g8"``, ``qsdp-w8g8``'s) or 4-bit (``"g4"``, ``sdp4bit``'s
``TwoLevelGrads`` without a mesh: every peer remote, its Hadamard-smoothed 4-bit quantizer);
DDP's all-reduce (compressed HSDP's across the nodes) uncompressed (``bf16``), in CGX's two
phases (``cgx``, ``qsdp-g8``) or Global-QSGD's int8 all-reduce (``global-qsgd``).

The bytes are the plans' own: each option's ``*_wire_bytes`` rule in :mod:`qsdp.comm` (what this
rank hands to ``torch.distributed``, [Note: one convention for bytes]): an all-gather's
(``all_gather_wire_bytes``, ``all_gather_diff_wire_bytes``; uncompressed, the shard's ``p``
bytes per element of the group's ``param_dtype``: 2 under bf16 compute), a reduce-scatter's
(``grads.plan().reduce_scatter_wire_bytes``; uncompressed ``PlainReduce``'s at ``g`` bytes of
the group's reduce dtype: 4 for fp32, 2 for bf16) and an all-reduce's
(``all_reduce_wire_bytes``, per DDP bucket). ``p`` and ``g`` are what the model's
``MixedPrecisionPolicy`` makes FSDP2 send: a model that reduces in bf16 halves what compression
can save on its gradients. Until 2026-11-27 the model priced quantizers of its own beside the
recipes, and they had drifted: 4-bit weight differences in groups of 128 (``sdp4bit`` sends
groups of 2048), 8-bit min-max weights (``qsdp-w8g8``'s are absmax), 4-bit absmax in groups of
128 for ``cgx`` (min-max in groups of 256).

Over a group of ``n`` ranks a collective takes its latency plus its bytes over the link's bus
bandwidth on a ring (NCCL's bus convention, in which :func:`measure` fits ``latency`` and
``bandwidth`` from all-gathers of two sizes on the group itself): an all-gather's ``b`` bytes
cross ``n - 1`` hops, ``(n - 1) b / bandwidth``; a reduce-scatter's or all-to-all's ``b``
already counts the ``n - 1`` peers' chunks, ``b / bandwidth``; an all-reduce's ``b`` (the whole
tensor, or two phases' ``n`` chunk payloads) is a reduce-scatter and an all-gather,
``2 (n - 1) / n b / bandwidth`` (two latencies; Global-QSGD's MAX of the scales a third). A
compressed collective adds the encodes and decodes of every element it touches (each rank
encodes its input and decodes what it receives), timed per call and per element at the
candidate's width (8 or 4 bits) on this device: two per element and gather of ``w8`` and one of
``wd4``, two per reduce-scatter, three per two-phase all-reduce, two per integer one.

Per training step (FSDP2, every group of ``m`` elements per rank) each collective is priced
apart, since their times add. On a two-level mesh of ``A`` nodes of ``B`` ranks, whose levels
are measured apart, the gradients have a fourth option, ``"tl"`` (SDP4Bit's two levels: the
same ``TwoLevelGrads`` over the mesh): its plan's bytes (``hierarchical_reduce_scatter_wire_
bytes``), of which the inter-node level carries the reduce-scatter of the node's partial sums
(``reduce_scatter_wire_bytes`` of ``A m`` elements over ``A`` ranks at the inter quantizer) and
the intra-node level the rest. The weights' gathers and the uncompressed reduce-scatter are
NCCL rings over the whole shard group, predicted from its own measurement; the one-level codes'
reduce-scatter is an all-to-all, whose chunks to the other nodes, ``(A - 1) B`` of its ``n -
1``, cross the measured inter-node level (on 4x H100 in the 2x2 regime the shard group's ring
measured 6.3 GB/s, the inter-node level 2.0 GB/s: the ring's figure made one-level 4-bit codes
look faster than two levels, 119 against 156 ms, where the step measured 0.469 s against 0.379
s; ``benchmarks/results/auto_2026-11-26/run3_h100/``).

The model leaves out compute and the host's time per collective, so it cannot know how much of
a collective's wire time FSDP2 (or DDP) hides behind compute: their collectives run on their own
streams, prefetched a group ahead, while the codecs run on the compute stream and are never
hidden. It counts ``WIRE_EXPOSED`` (half) of every wire time and all of every codec time, ranks
the options by that exposed communication and keeps the uncompressed one unless a compressed
option is predicted at most ``margin`` (0.8) of it: on a fast link compression is left off. With
the whole wire counted, 4x H200 NVLink chose 4-bit weight differences (predicted 10.6 ms against
15.6 ms, of which ~8 ms codec) and ran at 0.85x of plain FSDP2: the step is host-bound there
and the compressed path's launches (~1 ms per group, not modelled) cost +29 ms per step
(``benchmarks/results/auto_2026-11-27/``). Counting half, it would choose 4-bit weights only
where their wire saving exceeds about 3x their codec time; over sockets it is hundreds of times.
The whole wire counted is kept beside (``AutoDecision.predicted_serial_s``): what the step's
collectives take with no compute to hide them behind, as ``benchmarks/bench_fsdp_step.py
--bounds`` measures (the model's check). Every rank measures; the times are MAX-reduced, so
every rank predicts and picks the same. Checked against the GPU benchmark in
``docs/results.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import comm as qc
from ._measure import Measured

if TYPE_CHECKING:
    from ..config import CompressionConfig

__all__ = [
    "MARGIN",
    "WIRE_EXPOSED",
    "choose",
    "choose_fsdp",
    "predict_ddp",
    "predict_fsdp",
    "wire_bytes_ddp",
    "wire_bytes_fsdp",
]

WIRE_EXPOSED = 0.5
"""The share of a collective's wire time counted as exposed (see [Note: the cost model])."""

MARGIN = 0.8
"""A compressed option is chosen only if predicted at most this share of uncompressed."""

# --- the options: the named recipes' sub-configs (one definition of each) ---------------------
# FSDP2's weight all-gather and gradient reduce-scatter options, as (recipe, field); None:
# uncompressed. "g4" and "tl" are one sub-config (sdp4bit's TwoLevelGrads): "tl" reduces over
# compress_fsdp's two-level mesh, "g4" without it (every peer remote: its 4-bit quantizer).
_WEIGHTS: dict[str, tuple[str, str] | None] = {
    "none": None,
    "w8": ("qsdp-w8g8", "weights"),
    "wd4": ("sdp4bit", "weights"),
}
_GRADS: dict[str, tuple[str, str] | None] = {
    "none": None,
    "g8": ("qsdp-w8g8", "grads"),
    "g4": ("sdp4bit", "grads"),
    "tl": ("sdp4bit", "grads"),
}
# the all-reduce's options (DDP, compressed HSDP): named recipes, each its gradients
_ALL_REDUCE = ("bf16", "cgx", "qsdp-g8", "global-qsgd")


def _sub_config(source: tuple[str, str] | None) -> object | None:
    """The sub-config of a named recipe, e.g. ``("sdp4bit", "weights")``; None stays None."""
    from ..config import recipe  # at call time: qsdp.config imports qsdp.policy (ParamPolicy)

    return None if source is None else getattr(recipe(source[0]), source[1])


def _recipe_name(config: CompressionConfig) -> str | None:
    """The first named recipe whose config is ``config`` (None: none is)."""
    from ..config import RECIPES, recipe

    return next((name for name in RECIPES if recipe(name) == config), None)


# --- pricing ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Collective:
    """One collective an option runs: ``nbytes`` this rank hands to ``torch.distributed`` (its
    plan's ``*_wire_bytes``), crossing ``link`` as ``shape`` says (see the note)."""

    shape: str
    """``"gather"``, ``"exchange"`` (a reduce-scatter or all-to-all) or ``"all_reduce"``."""
    nbytes: int
    link: str = "group"
    """``"group"``, ``"intra"``, ``"inter"``, or ``"levels"`` (an all-to-all over both)."""
    latencies: int = 1


@dataclass(frozen=True)
class _Codec:
    """``times`` encode + decode calls of ``elements`` at ``bits``."""

    bits: int
    elements: float
    times: int = 1


_Cost = tuple[list[_Collective], list[_Codec]]


def _weight_costs(k: int, n: int, gb: int) -> dict[str, _Cost]:
    """The weight options of one FSDP2 group of ``k`` elements per rank (``gb`` bytes each)."""
    from ..config import WeightDiffs

    out: dict[str, _Cost] = {}
    for name, source in _WEIGHTS.items():
        sub = _sub_config(source)
        if sub is None:  # FSDP2's own gathers, in the forward and again in the backward
            out[name] = ([_Collective("gather", k * gb)] * 2, [])
        elif isinstance(sub, WeightDiffs):  # once: the backward reuses the reconstruction
            nbytes = qc.all_gather_diff_wire_bytes(k, sub.spec)
            out[name] = ([_Collective("gather", nbytes)], [_Codec(sub.spec.bits, n * k)])
        else:  # QuantizedWeights: the forward's gather and the backward's
            nbytes = qc.all_gather_wire_bytes(k, sub.spec)
            out[name] = ([_Collective("gather", nbytes)] * 2, [_Codec(sub.spec.bits, n * k, 2)])
    return out


def _grad_costs(k: int, n: int, rb: int, shape: tuple[int, int] | None) -> dict[str, _Cost]:
    """The gradient options of one FSDP2 group (``n k`` elements of ``rb`` bytes reduced to
    ``k``); ``"tl"`` only on an ``(A, B)`` mesh ``shape``."""
    plain = qc.PlainReduce(name="reduce_scatter")  # NCCL's ring reduce-scatter
    out: dict[str, _Cost] = {
        "none": (
            [_Collective("exchange", plain.reduce_scatter_wire_bytes(n * k, n, element_size=rb))],
            [],
        )
    }
    # the codes' reduce-scatter is an all-to-all: on a two-level mesh its chunks to other nodes
    # go over the slow level (a ring's bus bandwidth, measured on the shard group, counts the
    # fast hops too and would flatter it)
    link = "group" if shape is None else "levels"
    for name in ("g8", "g4"):
        plan = _sub_config(_GRADS[name]).plan()  # no mesh: one level
        nbytes = plan.reduce_scatter_wire_bytes(n * k, n)
        out[name] = (
            [_Collective("exchange", nbytes, link)],
            [_Codec(plan.width_spec.bits, n * k, 2)],
        )
    if shape is not None:
        a, b = shape
        grads = _sub_config(_GRADS["tl"])
        # what TwoLevelReduce.reduce_scatter_wire_bytes says over an (A, B) mesh; the inter-node
        # level's share: the node's partial sums (A k elements) reduce-scattered over A ranks
        total = qc.hierarchical_reduce_scatter_wire_bytes(n * k, a, b, grads.intra, grads.inter)
        inter = qc.reduce_scatter_wire_bytes(a * k, a, grads.inter)
        out["tl"] = (
            [
                _Collective("exchange", total - inter, "intra"),
                _Collective("exchange", inter, "inter"),
            ],
            [_Codec(grads.intra.bits, n * k, 2), _Codec(grads.inter.bits, n * k // b, 2)],
        )
    return out


def _all_reduce_costs(per: int, n: int, element_size: int) -> dict[str, _Cost]:
    """The all-reduce options of one bucket of ``per`` elements of ``element_size`` bytes."""
    from ..config import recipe

    out: dict[str, _Cost] = {}
    for name in _ALL_REDUCE:
        grads = recipe(name).grads
        plan = grads.plan() if grads is not None else qc.PlainReduce()
        nbytes = plan.all_reduce_wire_bytes(per, n, element_size=element_size)
        if isinstance(plan, qc.IntegerReduce):  # the MAX of the scales, the SUM of the int8 codes
            out[name] = ([_Collective("all_reduce", nbytes, latencies=3)], [_Codec(8, per, 2)])
        elif isinstance(plan, qc.QuantizedReduce):  # encode; decode, sum, re-encode; decode
            bits = plan.width_spec.bits
            out[name] = ([_Collective("all_reduce", nbytes, latencies=2)], [_Codec(bits, per, 3)])
        else:
            out[name] = ([_Collective("all_reduce", nbytes, latencies=2)], [])
    return out


def _fsdp_costs(
    shards: Sequence[int],
    n: int,
    shape: tuple[int, int] | None,
    compute_bytes: int | Sequence[int],
    reduce_bytes: int | Sequence[int],
) -> dict[str, dict[str, _Cost]]:
    """Every FSDP2 option's collectives and codecs over all groups, per step."""
    gather_b = _per_group(compute_bytes, len(shards), "compute_bytes")
    reduce_b = _per_group(reduce_bytes, len(shards), "reduce_bytes")
    out: dict[str, dict[str, _Cost]] = {"weights": {}, "grads": {}}
    for k, gb, rb in zip(shards, gather_b, reduce_b, strict=True):
        for part, costs in (
            ("weights", _weight_costs(k, n, gb)),
            ("grads", _grad_costs(k, n, rb, shape)),
        ):
            for name, (collectives, codecs) in costs.items():
                have = out[part].setdefault(name, ([], []))
                have[0].extend(collectives)
                have[1].extend(codecs)
    return out


def _ddp_costs(numel: int, n: int, buckets: int, element_size: int) -> dict[str, _Cost]:
    """Every all-reduce option over ``buckets`` near-equal buckets of ``numel`` elements."""
    if not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"buckets={buckets!r} must be a positive int (DDP's buckets per step)")
    out: dict[str, _Cost] = {}
    base, extra = divmod(numel, buckets)
    for size, count in ((base + 1, extra), (base, buckets - extra)):
        if count == 0:
            continue
        for name, (collectives, codecs) in _all_reduce_costs(size, n, element_size).items():
            have = out.setdefault(name, ([], []))
            have[0].extend(collectives * count)
            have[1].extend(codecs * count)
    return out


def _seconds(
    cost: _Cost,
    m: Measured,
    levels: tuple[Measured, Measured] | None,
    wire_exposed: float,
) -> float:
    """One option's predicted seconds: ``wire_exposed`` of its wire time, all its codec time."""
    collectives, codecs = cost
    wire = 0.0
    for c in collectives:
        if c.link == "levels":  # an all-to-all: (A - 1) B of its n - 1 chunks leave the node
            inter, intra = levels
            n = inter.world * intra.world
            chunk = c.nbytes / (n - 1)
            wire += (
                inter.latency_s
                + (n - intra.world) * chunk / inter.bytes_per_s
                + (intra.world - 1) * chunk / intra.bytes_per_s
            )
            continue
        link = {"group": m, "inter": levels and levels[0], "intra": levels and levels[1]}[c.link]
        n = link.world
        hops = {"gather": n - 1, "exchange": 1, "all_reduce": 2 * (n - 1) / n}[c.shape]
        wire += c.latencies * link.latency_s + hops * c.nbytes / link.bytes_per_s
    codec = sum(
        c.times * (m.codec_s_per_call.get(c.bits, 0.0) + m.codec_s_per_element[c.bits] * c.elements)
        for c in codecs
    )
    return wire_exposed * wire + codec


def predict_fsdp(
    shards: Sequence[int],
    m: Measured,
    *,
    levels: tuple[Measured, Measured] | None = None,
    compute_bytes: int | Sequence[int] = 2,
    reduce_bytes: int | Sequence[int] = 4,
    wire_exposed: float = WIRE_EXPOSED,
) -> dict[str, dict[str, float]]:
    """Predicted communication seconds per step of each option of each FSDP2 collective.

    Args:
        shards: elements per rank of each FSDP2 group.
        m: the whole shard group's measurement.
        levels: the (inter-node, intra-node) groups of a two-level mesh, measured apart: adds
            the gradients' ``"tl"`` option and sends the one-level codes' all-to-all over them.
        compute_bytes, reduce_bytes: bytes per element FSDP2 gathers and reduces uncompressed
            (its ``param_dtype`` and reduce dtype), one for all groups or one per group.
        wire_exposed: the share of each wire time counted (codecs count in full).

    Returns:
        ``{"weights": {"none", "w8", "wd4"}, "grads": {"none", "g8", "g4"[, "tl"]}}`` of seconds
        (see [Note: the cost model]); the collectives' times add, so each is chosen alone.
    """
    _check_exposed(wire_exposed)
    n = m.world
    shape = None
    if levels is not None:
        if levels[0].world * levels[1].world != n:
            raise ValueError(
                f"levels of {levels[0].world} x {levels[1].world} ranks do not make the shard "
                f"group's {n}: pass the (inter-node, intra-node) groups of the mesh FSDP shards on"
            )
        shape = (levels[0].world, levels[1].world)
    costs = _fsdp_costs(shards, n, shape, compute_bytes, reduce_bytes)
    return {
        part: {name: _seconds(c, m, levels, wire_exposed) for name, c in options.items()}
        for part, options in costs.items()
    }


def wire_bytes_fsdp(
    shards: Sequence[int],
    world: int,
    *,
    levels: tuple[int, int] | None = None,
    compute_bytes: int | Sequence[int] = 2,
    reduce_bytes: int | Sequence[int] = 4,
) -> dict[str, dict[str, int]]:
    """Bytes per step this rank hands to ``torch.distributed`` for each option of each FSDP2
    collective (the plans' ``*_wire_bytes``; see [Note: the cost model]), as
    :func:`predict_fsdp` prices them. ``levels``: the mesh's ``(A, B)`` shape, for ``"tl"``."""
    costs = _fsdp_costs(shards, world, levels, compute_bytes, reduce_bytes)
    return {
        part: {name: sum(c.nbytes for c in cols) for name, (cols, _) in options.items()}
        for part, options in costs.items()
    }


def _check_exposed(wire_exposed: float) -> None:
    if not 0 < wire_exposed <= 1:
        raise ValueError(
            f"wire_exposed={wire_exposed!r}: the share of a wire time counted is in (0, 1]"
        )


def _per_group(value: int | Sequence[int], groups: int, name: str) -> list[int]:
    values = [value] * groups if isinstance(value, int) else list(value)
    if len(values) != groups or any(not isinstance(v, int) or v <= 0 for v in values):
        raise ValueError(
            f"{name}={value!r}: give the bytes per element (a positive int) for all groups or "
            f"one per group ({groups})"
        )
    return values


def choose_fsdp(
    predicted: dict[str, dict[str, float]], *, margin: float = MARGIN
) -> tuple[str, str]:
    """(weights, gradients) options, each the fastest of its collective but uncompressed
    (``"none"``) unless predicted at most ``margin`` of uncompressed."""
    return _pick(predicted["weights"], "none", margin), _pick(predicted["grads"], "none", margin)


def predict_ddp(
    numel: int,
    m: Measured,
    *,
    buckets: int = 1,
    element_size: int = 4,
    wire_exposed: float = WIRE_EXPOSED,
) -> dict[str, float]:
    """Predicted exposed seconds per step of an all-reduce of ``numel`` gradients of
    ``element_size`` bytes in ``buckets`` near-equal buckets (DDP's; compressed HSDP's, one per
    module): uncompressed (``"bf16"``), CGX's two phases (``"cgx"``, ``"qsdp-g8"``),
    Global-QSGD (``"global-qsgd"``). ``wire_exposed`` as for :func:`predict_fsdp`."""
    _check_exposed(wire_exposed)
    costs = _ddp_costs(numel, m.world, buckets, element_size)
    return {name: _seconds(c, m, None, wire_exposed) for name, c in costs.items()}


def wire_bytes_ddp(
    numel: int, world: int, *, buckets: int = 1, element_size: int = 4
) -> dict[str, int]:
    """Bytes per step this rank hands to ``torch.distributed`` for each all-reduce option (the
    plans' ``all_reduce_wire_bytes``, bucket by bucket), as :func:`predict_ddp` prices them."""
    costs = _ddp_costs(numel, world, buckets, element_size)
    return {name: sum(c.nbytes for c in cols) for name, (cols, _) in costs.items()}


def choose(predicted: dict[str, float], *, margin: float = MARGIN) -> str:
    """The fastest option, but uncompressed (``"bf16"``) unless that option is predicted at
    most ``margin`` of it."""
    return _pick(predicted, "bf16", margin)


def _pick(options: dict[str, float], uncompressed: str, margin: float) -> str:
    best = min(options, key=options.get)
    return best if options[best] <= margin * options[uncompressed] else uncompressed
