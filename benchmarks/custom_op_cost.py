"""What a ``torch.library`` custom op would cost the host per codec call, against a plain call.

    PYTHONPATH=src python benchmarks/custom_op_cost.py --out r.json [--device cuda]

Issue 32 asks to weigh registering the codec kernels as ``torch.library`` custom ops (which
would give ``torch.compile`` a view of them) against their host cost. This times, per call, the
receive side of a reduce-scatter (``qsdp.quant.decode_sum_finish`` on a GPT block's chunk, the
Triton launch itself replaced by a no-op so only the host's work counts) three ways: called
directly, as qsdp's hooks call it; through a ``torch.library.custom_op`` that mutates its output
(the registration a compiled graph needs); and the custom op's dispatch alone (an empty body).
Rows: median microseconds per call over ``--calls``. Compare rows of one run: the CPU drifts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import host_per_bucket  # benchmarks/, the script's own folder: the kernel stubs
from qsdp.quant import QuantSpec, decode_sum_finish

SPEC = QuantSpec(bits=4, group_size=256, scheme="minmax", rounding="stochastic")
M = 49_536  # a GPT block's chunk at d 64 over 4 ranks (host_per_bucket.py's layout)


@torch.library.custom_op("qsdp_bench::decode_sum_finish", mutates_args=("out",))
def _as_op(payloads: torch.Tensor, base: torch.Tensor, out: torch.Tensor, divisor: int) -> None:
    decode_sum_finish(payloads, base.numel(), SPEC, base=base, out=out, divisor=divisor)


@torch.library.custom_op("qsdp_bench::nothing", mutates_args=("out",))
def _empty_op(payloads: torch.Tensor, base: torch.Tensor, out: torch.Tensor, divisor: int) -> None:
    return None


def _time(fn, calls: int, sync) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = p.parse_args()
    host_per_bucket._stub_kernels()
    dev = torch.device(a.device)
    payloads = torch.zeros(3, SPEC.payload_bytes(M), dtype=torch.uint8, device=dev)
    base = torch.randn(M, device=dev)
    out = torch.empty(M, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    rows = {
        "direct": _time(
            lambda: decode_sum_finish(payloads, M, SPEC, base=base, out=out, divisor=4),
            a.calls,
            sync,
        ),
        "custom_op": _time(lambda: _as_op(payloads, base, out, 4), a.calls, sync),
        "custom_op_dispatch_only": _time(lambda: _empty_op(payloads, base, out, 4), a.calls, sync),
    }
    for name, us in rows.items():
        print(f"{name:26s} {us:8.1f} us per call")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "custom_op_cost",
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "kernels": "stubbed",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "us_per_call": {k: round(v, 1) for k, v in rows.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
