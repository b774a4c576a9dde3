"""``"auto"``'s measurements: a group's link (latency and bus bandwidth, from all-gathers of two
sizes) and this device's quantizers (encode + decode per call and per element, by width), the
same on every rank (see [Note: the cost model] in ``qsdp.policy._cost``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import dist_all_gather
from ..quant import QuantSpec, decode, encode

__all__ = ["Measured", "agree", "measure"]

_PROBES = {
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
        codec += [_timed(lambda s=s, x=x: decode(encode(x, s)), device) for s in _PROBES.values()]
        del x
    agreed = torch.tensor([*times, *codec], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's view
    t_small, t_large, *codec = agreed.tolist()
    k = len(_PROBES)
    per_element, per_call = {}, {}
    for i, bits in enumerate(_PROBES):
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
    bits = list(_PROBES)
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
