"""What each host-side primitive of a hook costs on this machine, in microseconds a call.

    torchrun --nproc-per-node 2 benchmarks/host_primitives.py --out r.json   # GPUs, NCCL
    PYTHONPATH=src python benchmarks/host_primitives.py --out r.json          # CPU only

Issue 32's hooks are host-bound on a GPU machine whose host runs each torch op several times
slower than the development CPU. This prices the pieces a hook is made of, one at a time, on
the machine it runs on: a Python call, a tensor view, an allocation, the current stream, a
stream context, an event record and wait, a profiler scope, a Triton launch through
``JITFunction.run`` (qsdp's encode, real kernel), a collective's launch (NCCL with several
processes; skipped on one), and the device time of nothing (an empty kernel queue). Each row is
the median over ``--rounds`` rounds of ``--calls`` calls with no synchronisation in between (the
device runs behind; the host cost is what is timed); the device is synchronised between rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import qsdp


def _time(fn, calls: int, rounds: int, sync) -> float:
    for _ in range(min(calls, 50)):  # first-call work (caches, compiles) out of the timing
        fn()
    sync()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(per)


def _noop(a=None, b=None, c=None, d=None, e=None) -> None:
    return None


def _triton_rows(run, x: torch.Tensor, spec) -> None:
    """A Triton launch of qsdp's encode kernel (its 35 arguments by keyword, as qsdp's launchers
    pass them) through ``JITFunction.run``, against the same compiled kernel called directly
    (binding, specialization and cache lookup skipped)."""
    import triton

    from qsdp.quant._triton import kernels as K
    from qsdp.quant._triton import launch as L

    c = L._consts(spec, rotate=True, block=L._BLOCK)
    out = torch.empty(spec.payload_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    n_groups = spec.num_groups(x.numel())
    kw = dict(
        x_ptr=x, ref_ptr=x, out_ptr=out, signs_ptr=x, numel=x.numel(),
        scale_region=n_groups * spec.scale_bytes, n_code_bytes=spec.code_bytes(x.numel()),
        n_groups=n_groups, key0=0, key1=0, rng_stream=0, step=0, inv_sqrt_h=c.inv_sqrt_h,
        pid_base=0, x_row_stride=0, out_row_stride=0, skip_row=0, streams_ptr=x,
        **c.tile, **c.codes, **c.quantize, **c.rotation,
        HAS_REF=False, BIG=False, ALIGNED=True, MULTI=False, TAIL=False,
    )  # fmt: skip
    grid = (x.numel() // c.tile_numel, 1)
    launch = dict(num_warps=L._NUM_WARPS, enable_fp_fusion=False)
    compiled = K.encode_kernel[grid](**kw, **launch)
    run("triton launch: JITFunction.run (encode_kernel, 35 keyword arguments)",
        lambda: K.encode_kernel[grid](**kw, **launch))  # fmt: skip
    names = K.encode_kernel.arg_names
    device = triton.runtime.driver.active.get_current_device()

    def direct() -> None:
        args = [kw[k] for k in names]
        stream = triton.runtime.driver.active.get_current_stream(device)
        compiled.run(
            grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *args), None, None, *args,
        )  # fmt: skip

    run("triton launch: the compiled kernel called directly", direct)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if multi:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn(1 << 16, device=device)
    y = torch.empty_like(x)
    side = torch.cuda.Stream() if cuda else None
    event = torch.cuda.Event() if cuda else None
    # propagate: no check of the payload after the encode (the hooks' specs; "raise" reads it)
    spec = qsdp.quant.QuantSpec(
        bits=8, group_size=128, scheme="absmax", rounding="nearest", nonfinite="propagate"
    )
    rows: dict[str, float] = {}

    def run(name: str, fn) -> None:
        rows[name] = round(_time(fn, a.calls, a.rounds, sync), 2)

    run("python call (5 keyword arguments)", lambda: _noop(a=1, b=2, c=3, d=4, e=5))
    run("tensor.view(-1)", lambda: x.view(-1))
    run("tensor slice x[:100]", lambda: x[:100])
    run("torch.empty (256 KiB)", lambda: torch.empty(1 << 16, device=device))
    run("tensor.copy_ (256 KiB)", lambda: y.copy_(x))
    run("torch.add out-of-place (256 KiB)", lambda: torch.add(x, 1.0))

    def scope() -> None:
        with torch.profiler.record_function("qsdp::scope"):
            pass

    run("torch.profiler.record_function scope", scope)
    if cuda:
        run("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
        run("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(device))

        def stream_ctx() -> None:
            with torch.cuda.stream(side):
                pass

        run("with torch.cuda.stream(s): pass", stream_ctx)
        run("event.record()", lambda: event.record())
        run("stream.wait_event(e)", lambda: side.wait_event(event))
        run("tensor.record_stream(s)", lambda: x.record_stream(side))
    from qsdp.quant._triton import launch as L

    run("hash(QuantSpec)", lambda: hash(spec))
    run(
        "launch._consts(spec, ...) (an lru_cache lookup)",
        lambda: L._consts(spec, rotate=True, block=L._BLOCK),
    )  # noqa: E501
    codes = qsdp.quant.encode(x, spec)
    run("qsdp.quant.encode (64 Ki elements)", lambda: qsdp.quant.encode(x, spec))
    run("qsdp.quant.decode (64 Ki elements)", lambda: qsdp.quant.decode(codes))
    if cuda:
        _triton_rows(run, x, spec)
    if multi:
        n = dist.get_world_size()
        send = torch.randn(n * 1024, device=device)
        recv = torch.empty_like(send)
        run("dist.all_to_all_single (4 KiB a peer)", lambda: dist.all_to_all_single(recv, send))
        run(
            "dist.all_gather_into_tensor (4 KiB)",
            lambda: dist.all_gather_into_tensor(recv, send[:1024]),
        )
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        for k, v in rows.items():
            print(f"{v:9.2f} us  {k}")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps(
                {
                    "benchmark": "host_primitives",
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "codec_backend": "triton" if cuda else "reference",
                    "us_per_call": rows,
                },
                indent=2,
            )
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
