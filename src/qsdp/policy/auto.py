"""``recipe="auto"``: measure the link and the quantizers, predict each option, pick the fastest.

[Note: the cost model]
A collective over ``n`` ranks whose every rank hands over ``b`` bytes takes
``latency + (n - 1) / n * b_total / bandwidth`` on a ring, with ``b_total = n * b`` for an
all-gather and ``b`` for a reduce-scatter's or all-to-all's input (NCCL's bus-bandwidth
convention); an all-reduce is a reduce-scatter and an all-gather. :func:`measure` fits
``latency`` and ``bandwidth`` from all-gathers of two sizes on the group itself, and times the
quantizer's encode + decode per element at each width on this device. A compressed collective
costs its payload's wire time plus the encodes and decodes of every element it touches
(each rank encodes its input and decodes what it receives).

Per training step (FSDP2, every group of ``m`` elements per rank), each collective apart, since
their times add: the weights uncompressed ``2 * gather(p m)`` (FSDP2 gathers in the forward and
again in the backward, ``p`` bytes per element of the group's ``param_dtype``: 2 under bf16
compute), 8-bit (QSDP, the same two gathers of 8-bit payloads plus the codec) or 4-bit weight
differences (SDP4Bit, one gather: the backward reuses the reconstruction); the gradients
uncompressed ``reduce_scatter(g n m)`` (``g`` bytes of the group's reduce dtype: 4 for fp32, 2 for
bf16), 8-bit or 4-bit (SDP4Bit's Hadamard-smoothed quantizer). ``p`` and ``g`` are what the model's
``MixedPrecisionPolicy`` makes FSDP2 send: a model that reduces in bf16 halves what compression can
save on its gradients. On a two-level mesh of ``A`` nodes of ``B`` ranks, whose levels are measured
apart, the gradients have a fourth option, ``"tl"`` (SDP4Bit's two levels): an 8-bit all-to-all of
all ``n m`` elements inside the node, then a 4-bit all-to-all of the node's partial sums (``n m /
B`` elements) between the nodes. The weights' gathers and the uncompressed reduce-scatter are NCCL
rings over the whole shard group, predicted from its own measurement; the one-level codes'
reduce-scatter is an all-to-all, whose bytes to the other nodes, ``(A - 1) / A`` of them, cross the
measured inter-node level (on 4x H100 in the 2x2 regime the shard group's ring measured 6.3 GB/s,
the inter-node level 2.0 GB/s: the ring's figure made one-level 4-bit codes look faster than two
levels, 119 against 156 ms, where the step measured 0.469 s against 0.379 s;
``benchmarks/results/auto_2026-11-26/run3_h100/``). DDP: one all-reduce of the gradients per step
(their dtype's bytes; compressed HSDP: the reduce dtype), uncompressed or in CGX's two phases
(``cgx``, ``qsdp-g8``) or Global-QSGD's int8 all-reduce.

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
Every rank measures; the times are MAX-reduced, so every rank predicts and picks the same.
Checked against the GPU benchmark in ``docs/results.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import dist_all_gather
from ..quant import QuantSpec, decode, encode

__all__ = [
    "Measured",
    "agree",
    "choose",
    "decide_all_reduce",
    "decision_record",
    "choose_fsdp",
    "measure",
    "predict_ddp",
    "predict_fsdp",
    "report",
]

_SPECS = {
    8: QuantSpec(bits=8, group_size=128, scheme="minmax", rounding="stochastic"),
    4: QuantSpec(bits=4, group_size=128, scheme="absmax", rounding="stochastic"),
}


@dataclass(frozen=True)
class Measured:
    """What the cost model needs, the same on every rank."""

    latency_s: float
    """Per collective."""
    bytes_per_s: float
    """The ring's bus bandwidth."""
    codec_s_per_element: dict[int, float]
    """Encode + decode time per element, by width."""
    world: int
    codec_s_per_call: dict[int, float] = field(default_factory=dict)
    """Encode + decode time per call whatever its size (launches), by width; 0 if absent."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up (connections, kernel
    compilation). The fastest, not the median: noise on a shared host (another process's
    launches, a clock ramp) only ever adds time, and three medians of 4 MiB gathers on 4x H200
    NVLink read 259 to 1803 GB/s in one run (``benchmarks/results/auto_2026-11-27/``)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    sizes: tuple[int, int] | None = None,
    codec_sizes: tuple[int, int] | None = None,
) -> Measured:
    """Fit the link of ``group`` (all-gathers of two per-rank sizes) and the quantizers on
    ``device`` (encode + decode of two sizes: a cost per call, the launches, and per element).
    Collective: call on every rank of ``group``; every rank gets the same result. A group of
    one rank has no link: nothing crosses a wire (zero latency, infinite bandwidth), and only
    the quantizers are measured."""
    n = dist.get_world_size(group)
    if sizes is None:  # on a GPU the large gather must outlast the latency many times over:
        # 4 MiB per rank (16 MiB gathered at 4 ranks) took ~40 us on NVLink, too close to the
        # 64 KiB gather's ~30 us to give a slope; 128 MiB gathered takes ~0.3 ms there and
        # 0.1 s over a 1 GB/s socket, whatever the world size
        large = max(1 << 20, (1 << 27) // n) if device.type == "cuda" else 1 << 22
        sizes = (1 << 16, large)
    times = [0.0, 0.0]
    gather = dist_all_gather()
    for k, size in enumerate(sizes if n > 1 else ()):
        inp = torch.zeros(size, dtype=torch.uint8, device=device)
        out = torch.empty(n * size, dtype=torch.uint8, device=device)
        times[k] = _timed(lambda o=out, i=inp: gather(o, i, group=group), device)
    if codec_sizes is None:  # large enough on a GPU that launches do not hide the slope
        codec_sizes = (1 << 18, 1 << 24) if device.type == "cuda" else (1 << 12, 1 << 16)
    codec = []
    noise = torch.Generator(device).manual_seed(0)  # the user's RNG state stays as it was
    for numel in codec_sizes:
        x = torch.randn(numel, device=device, generator=noise)
        codec += [_timed(lambda s=s, x=x: decode(encode(x, s)), device) for s in _SPECS.values()]
        del x
    agreed = torch.tensor([*times, *codec], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's view
    t_small, t_large, *codec = agreed.tolist()
    k = len(_SPECS)
    per_element, per_call = {}, {}
    for i, bits in enumerate(_SPECS):
        small, large = codec[i], codec[k + i]
        per_element[bits] = max(large - small, 1e-15) / (codec_sizes[1] - codec_sizes[0])
        per_call[bits] = max(small - per_element[bits] * codec_sizes[0], 0.0)
    if n == 1:  # no link
        slope = latency = 0.0
    else:
        wire = (n - 1) / n * n * (sizes[1] - sizes[0])  # bus bytes between the two sizes
        slope = max(t_large - t_small, 1e-12) / wire
        latency = max(t_small - slope * (n - 1) * sizes[0], 0.0)
    return Measured(
        latency_s=latency,
        bytes_per_s=_rate(slope),
        codec_s_per_element=per_element,
        world=n,
        codec_s_per_call=per_call,
    )


def _rate(seconds_per_byte: float) -> float:
    """Bytes per second of a link taking ``seconds_per_byte`` (infinite for no link)."""
    return math.inf if seconds_per_byte == 0 else 1 / seconds_per_byte


def agree(
    measured: Sequence[Measured], group: dist.ProcessGroup | None, device: torch.device
) -> list[Measured]:
    """``measured`` made the same on every rank of ``group`` (each number its MAX over the
    group). Each level of a mesh is measured inside its own groups (node 0's intra-node group,
    node 1's, ...), which agree only within themselves; the shard group's ranks must predict and
    choose alike, or their collectives would not match. Collective over ``group``."""
    bits = list(_SPECS)
    rows = [
        [m.latency_s, 1 / m.bytes_per_s]
        + [m.codec_s_per_element[b] for b in bits]
        + [m.codec_s_per_call.get(b, 0.0) for b in bits]
        for m in measured
    ]
    t = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest group's view
    k = len(bits)
    return [
        Measured(
            latency_s=row[0],
            bytes_per_s=_rate(row[1]),
            codec_s_per_element=dict(zip(bits, row[2 : 2 + k], strict=True)),
            world=m.world,
            codec_s_per_call=dict(zip(bits, row[2 + k :], strict=True)),
        )
        for m, row in zip(measured, t.tolist(), strict=True)
    ]


WIRE_EXPOSED = 0.5
"""The share of a collective's wire time counted as exposed (see [Note: the cost model])."""


def _wire(m: Measured, total_bytes: float) -> float:
    """One ring collective moving ``total_bytes`` (bus convention, see the note)."""
    n = m.world
    return m.latency_s + (n - 1) / n * total_bytes / m.bytes_per_s


def _all_to_all(levels: tuple[Measured, Measured], total_bytes: float) -> float:
    """One all-to-all over a two-level mesh of ``A`` nodes of ``B`` ranks, each rank handing
    over ``total_bytes``: ``(A - 1) B / (A B)`` of them leave the node over the inter-node
    level, ``(B - 1) / (A B)`` stay inside over the intra-node level (the two in turn)."""
    inter, intra = levels
    n = inter.world * intra.world
    return (
        inter.latency_s
        + (n - intra.world) / n * total_bytes / inter.bytes_per_s
        + (intra.world - 1) / n * total_bytes / intra.bytes_per_s
    )


def _codec(m: Measured, bits: int, elements: float) -> float:
    """One encode + decode of ``elements`` (one call each)."""
    return m.codec_s_per_call.get(bits, 0.0) + m.codec_s_per_element[bits] * elements


def predict_fsdp(
    shards: Sequence[int],
    m: Measured,
    *,
    levels: tuple[Measured, Measured] | None = None,
    compute_bytes: int | Sequence[int] = 2,
    reduce_bytes: int | Sequence[int] = 4,
    wire_exposed: float = WIRE_EXPOSED,
) -> dict[str, dict[str, float]]:
    """Predicted communication seconds per step of each option of each FSDP2 collective, for
    groups of ``shards[i]`` elements per rank (see [Note: the cost model]): the weight
    all-gathers (``"none"``, ``"w8"``: QSDP's 8-bit weights, gathered twice; ``"wd4"``:
    SDP4Bit's 4-bit weight differences, gathered once) and the gradient reduce-scatters
    (``"none"``, ``"g8"``, ``"g4"``, and with ``levels``, the (inter-node, intra-node) groups of
    a two-level mesh measured apart, ``"tl"``). ``m`` is the whole shard group's measurement.
    ``compute_bytes`` and ``reduce_bytes``: bytes per element FSDP2 gathers and reduces
    uncompressed (its ``param_dtype`` and reduce dtype), one for all groups or one per group.
    ``wire_exposed``: the share of each wire time counted (codecs count in full). The
    collectives' times add, so each is chosen alone."""
    n = m.world
    _check_exposed(wire_exposed)

    def wire(meas: Measured, total_bytes: float) -> float:
        return wire_exposed * _wire(meas, total_bytes)

    def across(levels: tuple[Measured, Measured], total_bytes: float) -> float:
        return wire_exposed * _all_to_all(levels, total_bytes)

    gather_b = _per_group(compute_bytes, len(shards), "compute_bytes")
    reduce_b = _per_group(reduce_bytes, len(shards), "reduce_bytes")
    if levels is not None and levels[0].world * levels[1].world != n:
        raise ValueError(
            f"levels of {levels[0].world} x {levels[1].world} ranks do not make the shard "
            f"group's {n}: pass the (inter-node, intra-node) groups of the mesh FSDP shards on"
        )
    pay = {b: s.payload_bytes for b, s in _SPECS.items()}
    weights = {"none": 0.0, "w8": 0.0, "wd4": 0.0}
    grads = {"none": 0.0, "g8": 0.0, "g4": 0.0} | ({"tl": 0.0} if levels is not None else {})
    # the codes' reduce-scatter is an all-to-all: on a two-level mesh its bytes to other nodes
    # go over the slow level (a ring's bus bandwidth, measured on the shard group, counts the
    # fast hops too and would flatter it)
    exchange = (lambda b: wire(m, b)) if levels is None else (lambda b: across(levels, b))
    for k, gb, rb in zip(shards, gather_b, reduce_b, strict=True):
        weights["none"] += 2 * wire(m, n * k * gb)
        weights["w8"] += 2 * (wire(m, n * pay[8](k)) + _codec(m, 8, n * k))
        weights["wd4"] += wire(m, n * pay[4](k)) + _codec(m, 4, n * k)
        grads["none"] += wire(m, n * k * rb)  # NCCL's ring reduce-scatter
        grads["g8"] += exchange(n * pay[8](k)) + 2 * _codec(m, 8, n * k)
        grads["g4"] += exchange(n * pay[4](k)) + 2 * _codec(m, 4, n * k)
        if levels is not None:
            inter, intra = levels
            node = n * k // intra.world  # the node's partial sums each rank sends on
            grads["tl"] += (
                wire(intra, n * pay[8](k))
                + 2 * _codec(m, 8, n * k)
                + wire(inter, pay[4](node))
                + 2 * _codec(m, 4, node)
            )
    return {"weights": weights, "grads": grads}


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


def choose_fsdp(predicted: dict[str, dict[str, float]], *, margin: float = 0.8) -> tuple[str, str]:
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
    """Predicted exposed seconds per step of DDP's all-reduce of ``numel`` gradients of
    ``element_size`` bytes in ``buckets`` buckets: uncompressed, CGX's two phases (4 and 8
    bits), Global-QSGD (int8). ``wire_exposed`` as for :func:`predict_fsdp`."""
    _check_exposed(wire_exposed)

    def wire(meas: Measured, total_bytes: float) -> float:
        return wire_exposed * _wire(meas, total_bytes)

    pay = {b: s.payload_bytes for b, s in _SPECS.items()}
    per = numel / buckets
    plain = 2 * wire(m, per * element_size)  # a reduce-scatter and an all-gather of the bucket
    out = {"bf16": plain}
    for name, bits in (("cgx", 4), ("qsdp-g8", 8)):
        # phase 1 all-to-all of the codes, phase 2 all-gather of the re-encoded sums
        out[name] = 2 * wire(m, pay[bits](int(per))) + 3 * _codec(m, bits, per)
    out["global-qsgd"] = 2 * wire(m, per) + wire(m, 8) + 2 * _codec(m, 8, per)
    return {k: v * buckets for k, v in out.items()}


def choose(predicted: dict[str, float], *, margin: float = 0.8) -> str:
    """The fastest option, but uncompressed (``"bf16"``) unless that option is predicted at
    most ``margin`` of it."""
    return _pick(predicted, "bf16", margin)


def _pick(options: dict[str, float], uncompressed: str, margin: float) -> str:
    best = min(options, key=options.get)
    return best if options[best] <= margin * options[uncompressed] else uncompressed


def decide_all_reduce(
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    numel: int,
    buckets: int,
    element_size: int = 4,
) -> dict:
    """The recipe of a gradient all-reduce of ``numel`` elements of ``element_size`` bytes in
    ``buckets`` calls per step (DDP's buckets, compressed HSDP's replicate all-reduce): measure
    ``group``, predict each option, choose. Collective over ``group``; every rank decides the
    same."""
    measured = measure(group, device)
    predicted = predict_ddp(numel, measured, buckets=buckets, element_size=element_size)
    return {"recipe": choose(predicted), "predicted_s": predicted, "measured": measured}


def decision_record(decision: dict) -> dict:
    """A decision as JSON (config.json, benchmark rows): everything but the measured object,
    with the link it measured."""
    m = decision["measured"]
    return {k: v for k, v in decision.items() if k != "measured"} | {
        # a group of one rank has no link: JSON has no infinity
        "bus_gb_per_s": None if math.isinf(m.bytes_per_s) else m.bytes_per_s / 1e9,
        "latency_us": m.latency_s * 1e6,
    }


def report(m: Measured, predicted: dict, choice: str, *, options: dict | None = None) -> str:
    """One line of what ``"auto"`` measured, predicted and chose, ending with the chosen
    option's predicted communication per step against the uncompressed one's. ``options``: the
    chosen option per collective (FSDP2's ``{"weights": ..., "grads": ...}``); without it
    ``choice`` names one of ``predicted``'s options (DDP, HSDP's all-reduce)."""

    def ms(options: dict[str, float]) -> str:
        ranked = sorted(options.items(), key=lambda kv: kv[1])
        return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ranked)

    if options is not None:  # per collective: the times add
        parts = "; ".join(f"{part}: {ms(opts)}" for part, opts in predicted.items())
        chosen = sum(predicted[part][options[part]] for part in predicted)
        plain = sum(opts["none"] for opts in predicted.values())
    else:
        parts = ms(predicted)
        chosen, plain = predicted[choice], predicted["bf16"]
    return (
        f"qsdp auto: {m.world} ranks, link {m.bytes_per_s / 1e9:.2f} GB/s bus, latency "
        f"{m.latency_s * 1e6:.0f} us; predicted exposed communication per step ("
        f"{WIRE_EXPOSED:g} of each wire time, all codec time): {parts}; chose {choice}: "
        f"{chosen * 1e3:.1f} ms of communication per step against {plain * 1e3:.1f} ms "
        "uncompressed (compute and overlap not modelled)"
    )
