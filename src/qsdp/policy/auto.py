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

Per training step (FSDP2, every group of ``m`` elements per rank, bf16 compute, fp32 reduce):
uncompressed ``2 * gather(2 m) + reduce_scatter(4 n m)`` (FSDP2 gathers in the forward and again
in the backward); ``qsdp-w8g8`` the same with 8-bit payloads plus the codec; ``sdp4bit`` one
4-bit gather (the backward reuses the reconstruction) and a 4-bit reduce-scatter; ``qsdp-g8`` and
``cgx`` compress only the gradients. DDP: one all-reduce of the fp32 gradients per step,
uncompressed or in CGX's two phases (``cgx``, ``qsdp-g8``) or Global-QSGD's int8 all-reduce.

The model leaves out compute and the overlap with it, and the host's time per collective, so it
ranks the options by their communication time and keeps the uncompressed one unless a
compressed option is predicted at most ``margin`` (0.8) of it: on a fast link compression is
left off. Every rank measures; the times are MAX-reduced, so every rank predicts and picks the
same. Checked against the GPU benchmark in ``docs/results.md``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..quant import QuantSpec, decode, encode

__all__ = ["Measured", "choose", "measure", "predict_ddp", "predict_fsdp", "report"]

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up (connections, kernel compilation)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    sizes: tuple[int, int] = (1 << 16, 1 << 22),
    codec_elements: int = 1 << 20,
) -> Measured:
    """Fit the link of ``group`` (all-gathers of two per-rank sizes) and time the quantizers on
    ``device``. Collective: call on every rank of ``group``; every rank gets the same result."""
    n = dist.get_world_size(group)
    times = []
    for size in sizes:
        inp = torch.zeros(size, dtype=torch.uint8, device=device)
        out = torch.empty(n * size, dtype=torch.uint8, device=device)
        times.append(
            _timed(lambda o=out, i=inp: dist.all_gather_into_tensor(o, i, group=group), device)
        )
    x = torch.randn(codec_elements, device=device)
    codec = [
        _timed(lambda s=s: decode(encode(x, s)), device) / codec_elements for s in _SPECS.values()
    ]
    agreed = torch.tensor([*times, *codec], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's view
    t_small, t_large, *codec = agreed.tolist()
    wire = (n - 1) / n * n * (sizes[1] - sizes[0])  # bus bytes between the two sizes
    slope = max(t_large - t_small, 1e-12) / wire
    latency = max(t_small - slope * (n - 1) * sizes[0], 0.0)
    return Measured(
        latency_s=latency,
        bytes_per_s=1 / slope,
        codec_s_per_element=dict(zip(_SPECS, codec, strict=True)),
        world=n,
    )


def _wire(m: Measured, total_bytes: float) -> float:
    """One ring collective moving ``total_bytes`` (bus convention, see the note)."""
    n = m.world
    return m.latency_s + (n - 1) / n * total_bytes / m.bytes_per_s


def _codec(m: Measured, bits: int, elements: float) -> float:
    return m.codec_s_per_element[bits] * elements


def predict_fsdp(
    shards: Sequence[int], m: Measured, *, compute_bytes: int = 2, reduce_bytes: int = 4
) -> dict[str, float]:
    """Predicted communication seconds per step of each option, for FSDP2 groups of
    ``shards[i]`` elements per rank (see [Note: the cost model])."""
    n = m.world
    pay = {b: s.payload_bytes for b, s in _SPECS.items()}
    out = {"bf16": 0.0, "qsdp-w8g8": 0.0, "sdp4bit": 0.0, "qsdp-g8": 0.0, "cgx": 0.0}
    for k in shards:
        gather = _wire(m, n * k * compute_bytes)
        reduce = _wire(m, n * k * reduce_bytes)
        gather8 = _wire(m, n * pay[8](k)) + _codec(m, 8, n * k)
        gather4 = _wire(m, n * pay[4](k)) + _codec(m, 4, n * k)
        reduce8 = _wire(m, n * pay[8](k)) + 2 * _codec(m, 8, n * k)
        reduce4 = _wire(m, n * pay[4](k)) + 2 * _codec(m, 4, n * k)
        out["bf16"] += 2 * gather + reduce
        out["qsdp-w8g8"] += 2 * gather8 + reduce8
        out["sdp4bit"] += gather4 + reduce4
        out["qsdp-g8"] += 2 * gather + reduce8
        out["cgx"] += 2 * gather + reduce4
    return out


def predict_ddp(numel: int, m: Measured, *, buckets: int = 1) -> dict[str, float]:
    """Predicted seconds per step of DDP's all-reduce of ``numel`` fp32 gradients in
    ``buckets`` buckets: uncompressed, CGX's two phases (4 and 8 bits), Global-QSGD (int8)."""
    pay = {b: s.payload_bytes for b, s in _SPECS.items()}
    per = numel / buckets
    plain = 2 * _wire(m, per * 4)  # a reduce-scatter and an all-gather of the bucket
    out = {"bf16": plain}
    for name, bits in (("cgx", 4), ("qsdp-g8", 8)):
        # phase 1 all-to-all of the codes, phase 2 all-gather of the re-encoded sums
        out[name] = 2 * _wire(m, pay[bits](int(per))) + 3 * _codec(m, bits, per)
    out["global-qsgd"] = 2 * _wire(m, per) + _wire(m, 8) + 2 * _codec(m, 8, per)
    return {k: v * buckets for k, v in out.items()}


def choose(predicted: dict[str, float], *, margin: float = 0.8) -> str:
    """The fastest option, but uncompressed (``"bf16"``) unless that option is predicted at
    most ``margin`` of it."""
    best = min(predicted, key=predicted.get)
    return best if predicted[best] <= margin * predicted["bf16"] else "bf16"


def report(m: Measured, predicted: dict[str, float], choice: str) -> str:
    """One line of what ``"auto"`` measured, predicted and chose."""
    options = ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in sorted(predicted.items(), key=lambda kv: kv[1])
    )
    return (
        f"qsdp auto: {m.world} ranks, link {m.bytes_per_s / 1e9:.2f} GB/s bus, latency "
        f"{m.latency_s * 1e6:.0f} us; predicted communication per step: {options}; chose {choice}"
    )
