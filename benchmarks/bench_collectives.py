"""qsdp's compressed collectives beside the matching NCCL collective, on 4 GPUs of one host.

    torchrun --nproc-per-node 4 benchmarks/bench_collectives.py --regime nvlink \
        --out benchmarks/results/collectives_<date>/collectives_nvlink.json

(``benchmarks/run_collectives.sh`` runs the three regimes with the environment of
``docs/gpu.md``.) For messages of 16 MiB, 256 MiB and 1 GiB (the uncompressed collective's full
tensor: all-gather output, reduce-scatter input, all-reduce tensor) in bf16 and fp32, each qsdp
collective is timed beside its NCCL twin on the same inputs: median milliseconds over ``--reps``
(CUDA events, warm-up first, the slowest rank's median), effective bandwidth = uncompressed bytes
/ time, and the ratio ``nccl_ms / ms`` (above 1: qsdp is faster). Before timing, every
configuration is checked once against the exact NCCL result (relative L2 error under the
variant's tolerance; all-gather and all-reduce outputs bit-identical on all ranks) and its
bytes handed to torch.distributed against ``*_wire_bytes``. Rows carry the device name, torch
version, date and regime; ``--out`` ending in ``.csv`` writes CSV, otherwise JSON.

Regimes (all with NVLink multicast off): ``nvlink`` (default NCCL), ``socket`` (every GPU its own
node over TCP on loopback) and ``2x2`` (two "nodes" of two GPUs through ``NCCL_HOSTID``; the
two-level reduce-scatter's mesh matches them). ``--device cpu`` runs a gloo smoke test of the
script itself (tiny sizes; timings meaningless).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import qsdp.comm as qc
import regimes  # benchmarks/, the script's own folder
from qsdp.quant import QuantSpec

W8 = QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="nearest")
W4 = QuantSpec(bits=4, group_size=128, scheme="absmax", rounding="stochastic", hadamard_block=32)
G8 = QuantSpec(bits=8, group_size=128, scheme="absmax", rounding="stochastic")
G4 = QuantSpec(
    bits=4,
    group_size=128,
    scheme="absmax",
    rounding="stochastic",
    hadamard_block=32,
    hadamard_seed=1,
)
G8H = QuantSpec(
    bits=8,
    group_size=128,
    scheme="absmax",
    rounding="stochastic",
    hadamard_block=32,
    hadamard_seed=1,
)


@dataclass(frozen=True)
class Variant:
    """One qsdp collective and the NCCL collective it replaces."""

    name: str
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce": the NCCL baseline
    run: Callable[..., qc.CommWork | None]  # (out, x, *, stats=); all-reduce: in place on out
    wire: Callable[[int, int], int]  # (full numel, world size) -> bytes one rank hands over
    tol: float  # relative L2 error against the exact result


def variants(mesh) -> list[Variant]:
    ag, rs, ar = "all_gather", "reduce_scatter", "all_reduce"
    two_level = dict(mesh=mesh, intra_spec=G8H, inter_spec=G4)
    return [
        Variant(
            "all_gather w8",
            ag,
            partial(qc.all_gather, spec=W8),
            lambda n, w: qc.all_gather_wire_bytes(n // w, W8),
            0.02,
        ),
        Variant(
            "all_gather w4 h32",
            ag,
            partial(qc.all_gather, spec=W4),
            lambda n, w: qc.all_gather_wire_bytes(n // w, W4),
            0.3,
        ),
        Variant(
            "reduce_scatter g8",
            rs,
            partial(qc.reduce_scatter, spec=G8),
            lambda n, w: qc.reduce_scatter_wire_bytes(n, w, G8),
            0.05,
        ),
        Variant(
            "reduce_scatter g4 h32",
            rs,
            partial(qc.reduce_scatter, spec=G4),
            lambda n, w: qc.reduce_scatter_wire_bytes(n, w, G4),
            0.4,
        ),
        Variant(
            "two_level 8/4 h32",
            rs,
            partial(qc.hierarchical_reduce_scatter, **two_level),
            lambda n, w: qc.hierarchical_reduce_scatter_wire_bytes(n, 2, w // 2, G8H, G4),
            0.4,
        ),
        Variant(
            "two_level 8/4 h32 pipe4",
            rs,
            partial(qc.hierarchical_reduce_scatter, **two_level, pipeline=4),
            lambda n, w: qc.hierarchical_reduce_scatter_wire_bytes(
                n, 2, w // 2, G8H, G4, pipeline=4
            ),
            0.4,
        ),
        Variant(
            "integer_reduce_scatter int8",
            rs,
            partial(qc.integer_reduce_scatter, carrier="int8"),
            lambda n, w: qc.integer_reduce_scatter_wire_bytes(n, w, carrier="int8"),
            0.2,
        ),
        Variant(
            "integer_all_reduce int8",
            ar,
            _in_place(qc.integer_all_reduce, carrier="int8"),
            lambda n, w: qc.integer_all_reduce_wire_bytes(n, carrier="int8"),
            0.2,
        ),
        Variant(
            "two_phase g8",
            ar,
            _in_place(qc.two_phase_all_reduce, spec=G8),
            lambda n, w: qc.two_phase_all_reduce_wire_bytes(n, w, G8),
            0.05,
        ),
    ]


def _in_place(fn, **options):
    """An all-reduce as ``(out, x, **kw)``: it reduces ``out`` in place (x is its source)."""

    def run(out, x, **kw):
        return fn(out, **options, **kw)

    return run


# --- NCCL baselines ---------------------------------------------------------------------------
def _avg_op(device: torch.device):
    # gloo (the CPU smoke run) has no AVG: SUM there, divided by the caller.
    return dist.ReduceOp.AVG if device.type == "cuda" else dist.ReduceOp.SUM


def nccl(kind: str, out: torch.Tensor, x: torch.Tensor, ws: int) -> None:
    """The uncompressed collective (AVG for the reductions); ``all_reduce`` works on ``out``."""
    op = _avg_op(x.device)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x)
    elif kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, x, op=op)
    else:
        dist.all_reduce(out, op=op)
    if op == dist.ReduceOp.SUM and kind != "all_gather":
        out.div_(ws)


def buffers(kind: str, numel: int, ws: int, dtype, device, rank: int):
    """(out, x) for one call: x is this rank's input, out the result buffer (for all-reduce the
    tensor reduced in place, refilled from x before each call)."""
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    n_in = numel // ws if kind == "all_gather" else numel
    x = torch.randn(n_in, generator=g, device=device, dtype=torch.float32).to(dtype)
    n_out = numel // ws if kind == "reduce_scatter" else numel
    return torch.empty(n_out, device=device, dtype=dtype), x


# --- timing and checks ------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], None], reps: int, warmup: int, device: torch.device) -> float:
    """The slowest rank's median time of ``fn`` in milliseconds."""
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def check(v: Variant, numel: int, ws: int, dtype, device, rank: int) -> float:
    """Run ``v`` once against the exact collective on the same inputs; returns the rel. error."""
    out, x = buffers(v.kind, numel, ws, dtype, device, rank)
    exact = torch.empty_like(out)
    if v.kind == "all_reduce":
        exact.copy_(x)
        out.copy_(x)
    nccl(v.kind, exact, x.clone(), ws)
    stats = qc.CommStats()
    v.run(out, x, stats=stats)
    sync(device)
    err = float((out.double() - exact.double()).norm() / exact.double().norm())
    worst = torch.tensor([err], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if float(worst) > v.tol:
        raise SystemExit(
            f"{v.name} {dtype} numel={numel}: relative error {float(worst):.3g} "
            f"exceeds {v.tol} against the exact collective"
        )
    if v.kind != "reduce_scatter":
        ref = out.clone()
        dist.broadcast(ref, src=0)
        if not torch.equal(ref, out):
            raise SystemExit(f"{v.name} {dtype}: outputs differ between ranks")
    wire = v.wire(numel, ws)
    # the collective's own bytes: *_wire_bytes leave out the NaN/Inf verdict's (world + 1) int64
    sent = stats.total_bytes - stats["nonfinite_check"].bytes
    if sent != wire:
        raise SystemExit(f"{v.name}: {sent} bytes handed over, expected {wire}")
    return float(worst)


# --- main -------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regime", choices=sorted(regimes.REGIMES), required=True)
    p.add_argument("--out", type=Path, required=True, help="results file (.json or .csv)")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 256, 1024])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="variant names to run (default all)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env = regimes.apply(a.regime, local_rank, a.device)
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "bench_collectives.py needs CUDA GPUs (or --device cpu for a smoke run)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        device_name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        device_name = "cpu (gloo smoke run)"
    rank, ws = dist.get_rank(), dist.get_world_size()
    if ws % 2 or (a.device == "cuda" and ws != 4):
        raise SystemExit(f"run under torchrun --nproc-per-node 4 (got world size {ws})")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (2, ws // 2), mesh_dim_names=("inter", "intra"))
    chosen = [v for v in variants(mesh) if a.only is None or v.name in a.only]
    meta = {
        "benchmark": "bench_collectives",
        "device": device_name,
        "world_size": ws,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "regime": a.regime,
        "env": env,
    }
    rows: list[dict] = []
    for dtype_name in a.dtypes:
        dtype = getattr(torch, dtype_name)
        for size in a.sizes_mib:
            numel = int(size * 2**20) // dtype.itemsize // (ws * 128) * (ws * 128)
            nbytes = numel * dtype.itemsize
            base_ms: dict[str, float] = {}
            for v in chosen:
                if v.kind not in base_ms:
                    out, x = buffers(v.kind, numel, ws, dtype, device, rank)
                    src = x.clone()

                    def run_nccl(out=out, x=x, src=src, kind=v.kind):
                        if kind == "all_reduce":
                            out.copy_(src)
                        nccl(kind, out, x, ws)

                    base_ms[v.kind] = median_ms(run_nccl, a.reps, a.warmup, device)
                    plain = nbytes if v.kind != "all_gather" else nbytes // ws
                    rows.append(
                        row(
                            meta,
                            f"nccl {v.kind}",
                            v.kind,
                            dtype_name,
                            size,
                            numel,
                            base_ms[v.kind],
                            nbytes,
                            base_ms[v.kind],
                            plain,
                            0.0,
                            rank,
                        )
                    )
                    del out, x, src
                err = check(v, numel, ws, dtype, device, rank)
                out, x = buffers(v.kind, numel, ws, dtype, device, rank)
                src = x.clone()

                def run_qsdp(out=out, x=x, src=src, v=v):
                    if v.kind == "all_reduce":
                        out.copy_(src)
                    v.run(out, x)

                ms = median_ms(run_qsdp, a.reps, a.warmup, device)
                rows.append(
                    row(
                        meta,
                        v.name,
                        v.kind,
                        dtype_name,
                        size,
                        numel,
                        ms,
                        nbytes,
                        base_ms[v.kind],
                        v.wire(numel, ws),
                        err,
                        rank,
                    )
                )
                del out, x, src
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if rank == 0:
        write(a.out, meta, rows)
    dist.destroy_process_group()


def row(meta, variant, kind, dtype, size, numel, ms, nbytes, nccl_ms, wire, err, rank) -> dict:
    r = {
        "device": meta["device"],
        "torch": meta["torch"],
        "date": meta["date"],
        "regime": meta["regime"],
        "world_size": meta["world_size"],
        "collective": kind,
        "variant": variant,
        "dtype": dtype,
        "size_mib": size,
        "numel": numel,
        "ms": round(ms, 4),
        "eff_gb_per_s": round(nbytes / ms / 1e6, 2),
        "nccl_ms": round(nccl_ms, 4),
        "ratio_vs_nccl": round(nccl_ms / ms, 3),
        "wire_bytes_per_rank": wire,
        "rel_err": round(err, 5),
    }
    if rank == 0:
        print(
            f"{meta['regime']:<7} {variant:<30} {dtype:<9} {size:>7g} MiB  {ms:9.3f} ms  "
            f"{r['eff_gb_per_s']:8.2f} GB/s  x{r['ratio_vs_nccl']:<6} err {err:.2e}",
            flush=True,
        )
    return r


def write(path: Path, meta: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        path.write_text(json.dumps(meta | {"rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
