"""Line by line: where a recipe's hooks spend the host's time (``line_profiler``).

    pip install line_profiler
    PYTHONPATH=src python benchmarks/host_lines.py --recipe sdp4bit --device cuda --out r.txt

The model, process group and step of ``host_per_step.py`` (GPT blocks, a ``fake`` group of 4,
the backward on the calling thread), every function of qsdp's hot-path modules under
``line_profiler`` for ``--steps`` steps. Writes the functions by time per step (a line's time
includes the calls it makes, so a function's total is inclusive), then the lines of the
``--top`` most expensive ones. The profiler adds about a microsecond per line run, so compare
lines within one file; ``host_per_step.py`` gives the unprofiled step.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import host_per_bucket  # benchmarks/, the script's own folder: the kernel stubs
import host_per_step

MODULES = (
    "qsdp.fsdp._hooks",
    "qsdp.fsdp._gathers",
    "qsdp.fsdp._reduce",
    "qsdp.fsdp._groups",
    "qsdp.comm._common",
    "qsdp.comm._reduce_scatter",
    "qsdp.comm._all_gather",
    "qsdp.comm._weight_diff",
    "qsdp.comm._hierarchical",
    "qsdp.comm._split",
    "qsdp.comm._plans",
    "qsdp.comm._calls",
    "qsdp.comm._stats",
    "qsdp.quant.codec",
    "qsdp.quant.flags",
    "qsdp.quant._triton.launch",
    "qsdp.runtime.nonfinite",
    "qsdp.runtime.streams",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="sdp4bit")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=14, help="functions whose lines are listed")
    p.add_argument("--stub", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    try:
        from line_profiler import LineProfiler
    except ImportError as e:
        raise SystemExit("host_lines.py needs line_profiler: pip install line_profiler") from e
    if a.stub if a.stub is not None else a.device == "cpu":
        host_per_bucket._stub_kernels()
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "OFF")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    model = host_per_step.build(a.recipe, a.blocks, a.d, block="gpt", device=a.device)
    x = torch.randn(4, a.d, device=a.device)

    def step() -> None:
        model(x).pow(2).mean().backward()

    for _ in range(5):
        step()
    lp = LineProfiler()
    with warnings.catch_warnings():  # (decorated functions: the wrapper is profiled too)
        warnings.simplefilter("ignore")
        for name in MODULES:
            lp.add_module(importlib.import_module(name))
    with torch.autograd.set_multithreading_enabled(False):  # hooks on this thread
        lp.enable_by_count()
        for _ in range(a.steps):
            step()
        lp.disable_by_count()
    if a.device == "cuda":
        torch.cuda.synchronize()
    stats = lp.get_stats()
    per_step = stats.unit * 1e6 / a.steps  # -> microseconds per step
    funcs = []
    for (path, line, fn), lines in stats.timings.items():
        total = sum(t for _, _, t in lines) * per_step
        calls = next((h for ln, h, _ in lines if ln > line), 0) / a.steps
        if total > 0:
            funcs.append((total, calls, path, line, fn, lines))
    funcs.sort(key=lambda f: -f[0])
    out = io.StringIO()
    out.write(f"{a.recipe} on {a.device}, {a.steps} steps, {a.blocks} blocks; us per step\n\n")
    out.write("  us/step  calls/step  us/call  function (inclusive: a line counts its calls)\n")
    for total, calls, path, line, fn, _ in funcs[:60]:
        short = path.split("/src/")[-1]
        out.write(f"{total:9.0f} {calls:11.1f} {total / max(calls, 1):8.1f}  {fn} {short}:{line}\n")
    for total, _, path, line, fn, lines in funcs[: a.top]:
        out.write(f"\n== {fn} ({path.split('/src/')[-1]}:{line}): {total:.0f} us/step\n")
        src = Path(path).read_text().splitlines()
        for ln, hits, t in sorted(lines):
            us = t * per_step
            if us >= 0.02 * total:
                text = src[ln - 1].strip()[:90] if ln <= len(src) else ""
                out.write(f"{us:9.0f} us {hits / a.steps:7.1f}x  {ln:5d}  {text}\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(out.getvalue())
    print(out.getvalue()[:3000])


if __name__ == "__main__":
    main()
