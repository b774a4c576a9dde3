"""Host time of one DDP bucket's compressed all-reduce, without communication or kernels.

    PYTHONPATH=src python benchmarks/host_per_bucket.py --out r.json [--recipes cgx ...]
    PYTHONPATH=src python benchmarks/host_per_bucket.py --collective reduce_scatter \
        --device cuda --out r.json       # FSDP2's reduce-scatter, the real kernels on a GPU

What a GPU step pays on the CPU per bucket besides the kernels' own launches: qsdp's Python,
torch op dispatch and the collectives' calls. Runs on any machine: a ``fake`` process group of
4 ranks (collectives return at once) and the quantizer kernels replaced by no-ops inside this
process only (``--stub``, the default), so neither wire nor kernel time is counted. The bucket
is a GPT block's (d 64, 12 parameters, the 1-D ones raw by the default policy). Rows: median
microseconds per bucket over 200 calls, and the number of top-level torch ops of one call.
The CPU matters: compare rows of one run (or of runs on the same machine).

``--collective reduce_scatter``: FSDP2's gradient reduce-scatter of the same block (a
``[4, chunk]`` input, the plan's ``reduce_scatter``). ``--device cuda`` runs on a GPU with the
real Triton kernels (``--stub`` keeps them no-ops there too): the difference between the two
rows of a recipe is what its kernel launches cost the host. Each call starts with an empty
device queue (a synchronisation before it, untimed), so a row is the host's time alone.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import qsdp
import qsdp.quant.codec as codec
from qsdp import comm as qc

D = 64
LAYOUT = [
    ("mlp.fc2.bias", D),
    ("mlp.fc2.weight", 4 * D * D),
    ("mlp.fc1.bias", 4 * D),
    ("mlp.fc1.weight", 4 * D * D),
    ("ln2.bias", D),
    ("ln2.weight", D),
    ("attn.proj.bias", D),
    ("attn.proj.weight", D * D),
    ("attn.qkv.bias", 3 * D),
    ("attn.qkv.weight", 3 * D * D),
    ("ln1.bias", D),
    ("ln1.weight", D),
]


class _NoKernel:
    """A Triton kernel that launches nothing: the launchers' Python (arguments, grids) runs as
    on a GPU, the kernel itself is skipped."""

    def __init__(self, kernel) -> None:
        self.arg_names = kernel.arg_names

    def run(self, *args, **kwargs) -> None:
        return None

    def __getitem__(self, grid):  # (kernel[grid](...): an older commit's launchers)
        return self.run


def _stub_kernels() -> None:
    """Every Triton kernel a no-op, and the Triton path taken on the CPU (this process only):
    qsdp's launchers still run, so their host work is counted."""
    import triton

    from qsdp.quant._triton import kernels

    for name, obj in vars(kernels).items():
        if isinstance(obj, triton.runtime.jit.KernelInterface):
            setattr(kernels, name, _NoKernel(obj))
    codec._resolve = lambda backend, device: "triton"
    import qsdp.quant.flags as flags
    import qsdp.quant.global_int as global_int

    global_int._resolve = codec._resolve
    flags._resolve = codec._resolve  # (imported by name: patched where it is read)
    # weight prediction's kernel (staleness 1): its launcher's Python as on a GPU
    from qsdp.runtime import _adam_triton, adam_step

    _adam_triton.adam_predict_kernel = _NoKernel(_adam_triton.adam_predict_kernel)
    adam_step._kernel_applies = lambda outs, xs, step: True
    try:  # (an older commit's code, run beside the tree's for a before/after, has none)
        import qsdp.quant.rowsum as rowsum
    except ImportError:
        return
    rowsum._resolve = codec._resolve


def measure(
    name: str, calls: int, collective: str = "all_reduce", device: str = "cpu", mesh=None
) -> dict:
    config = qsdp.recipe(name)
    plan = config.grads.plan(mesh=mesh)
    shapes = [(n, k, (k,) if k in (D, 3 * D, 4 * D) else (k // D, D)) for n, k in LAYOUT]
    split = config.policy.split(shapes) if config.policy else None
    chunk = sum(k for _, k in LAYOUT)
    t = torch.randn(chunk, device=device)
    rows = torch.randn(4, chunk, device=device)  # FSDP2's rank-major reduce-scatter input
    out = torch.empty(chunk, device=device)
    stats = qc.CommStats()

    def call(i: int) -> None:
        if collective == "reduce_scatter":
            plan.reduce_scatter(
                out, rows, None, op="avg", split=split, seed=0, step=i, bucket=0, stats=stats
            )
            return
        work = plan.all_reduce(
            t, None, op="avg", split=split, seed=0, step=i, bucket=0, stats=stats, async_op=True
        )
        work.get_future().wait()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for i in range(20):
        call(i)
    times = []
    for i in range(calls):
        sync()
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    sync()
    stats.reset()  # (the profiled call's counts: which qsdp collectives one call runs)
    with torch.profiler.profile() as prof:
        call(0)
        sync()
    ran = {k: {"calls": c.calls, "dist_calls": c.dist_calls} for k, c in stats.snapshot().items()}
    top = collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)
    launches = sum(n for k, n in top.items() if "LaunchKernel" in k)
    return {
        "recipe": name,
        "collective": collective,
        "mesh": "2x2" if mesh is not None else None,
        "us_per_bucket": statistics.median(times) * 1e6,
        "top_level_ops": sum(top.values()),
        "collectives": ran,
        "launches": launches,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", nargs="*", default=["cgx", "global-qsgd", "qsdp-g8"])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--label", default="", help="a name for this code version in the JSON")
    p.add_argument("--collective", choices=["all_reduce", "reduce_scatter"], default="all_reduce")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--stub",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kernels as no-ops (default: on the CPU yes, on a GPU no)",
    )
    p.add_argument(
        "--mesh",
        choices=["2x2"],
        help="the reduce-scatter over a 2-D (inter, intra) mesh: the two-level plans "
        "(sdp4bit's) take their two-level path",
    )
    a = p.parse_args()
    if a.mesh and a.collective != "reduce_scatter":
        raise SystemExit("--mesh 2x2 times --collective reduce_scatter (the two-level path)")
    if a.device == "cuda" and a.collective == "all_reduce":
        raise SystemExit(
            "--device cuda times --collective reduce_scatter: the all-reduce's CUDA future "
            "needs a real backend, not the fake process group"
        )
    stub = a.stub if a.stub is not None else a.device == "cpu"
    if stub:
        _stub_kernels()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = None
    if a.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(a.device, (2, 2), mesh_dim_names=("inter", "intra"))
    rows = [measure(name, a.calls, a.collective, a.device, mesh) for name in a.recipes]
    for r in rows:
        us, ops = r["us_per_bucket"], r["top_level_ops"]
        print(
            f"{r['recipe']:12s} {a.collective}{' 2x2' if a.mesh else ''} {us:7.0f} us per "
            f"call, {ops} ops, "
            f"{r['launches']} launches ({a.device}, kernels {'stubbed' if stub else 'real'})"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "host_per_bucket",
                "label": a.label,
                "collective": a.collective,
                "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                "kernels": "stubbed" if stub else "real",
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "world_size": 4,
                "rows": rows,
            },
            indent=2,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
